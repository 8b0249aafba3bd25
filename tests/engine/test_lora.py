"""LoRA pieces on a toy-shaped model, without DeepSpeed: fresh adapters change nothing, the merged weights
give the adapted model's log-probs, names map back to the base model's, bad targets and other bases are
named, and the base's digest is the hub's where the hub already computed it."""

import hashlib
import os

import pytest
import torch

from trapo.config import ConfigError, LoraConfig
from trapo.engine import lora


def toy_model(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trapo.commands.toy import MODEL_SHAPE

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, **MODEL_SHAPE, dtype="float32")).eval()


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.double(), -1)


IDS = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))


def test_fresh_adapters_give_the_base_models_outputs_exactly():
    base = toy_model()
    adapted = lora.attach(toy_model(), LoraConfig(rank=8, alpha=16.0))
    assert torch.equal(logprobs(base, IDS), logprobs(adapted, IDS))  # B = 0: the update is exactly zero
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)  # the base is frozen
    # 2 layers x 7 projections, A [8, in] and B [out, 8]
    assert len(trainable) == 2 * 7 * 2


def test_merged_weights_give_the_adapted_models_logprobs():
    adapted = lora.attach(toy_model(), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # a trained adapter: B away from zero
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    scale = lora.scalings(adapted)
    assert scale == {
        f"model.layers.{i}.{m}": 2.0
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    state = dict(lora.merged(((n, p.detach().clone()) for n, p in adapted.named_parameters()), scale))
    before = {n: p.detach().clone() for n, p in adapted.named_parameters()}
    plain = toy_model(seed=5)
    assert set(state) == set(plain.state_dict())  # every base name, no adapter names
    plain.load_state_dict(state)
    diff = (logprobs(plain, IDS) - logprobs(adapted, IDS)).abs().max().item()
    assert 0 < diff < 1e-5 or diff == 0, diff
    assert (logprobs(plain, IDS) - logprobs(toy_model(), IDS)).abs().max() > 1e-3  # the adapters did change it
    # the merge wrote copies: the adapted model's base weights are untouched, bit for bit (no merge / unmerge)
    assert all(torch.equal(p, before[n]) for n, p in adapted.named_parameters())


def test_merge_weight_is_w_plus_scaled_ba():
    w, a, b = torch.ones(3, 2), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [-1.0]])
    assert torch.equal(lora.merge_weight(w, a, b, 0.5), torch.tensor([[1.5, 2.0], [1.0, 1.0], [0.5, 0.0]]))
    w16 = torch.ones(3, 2, dtype=torch.bfloat16)
    assert lora.merge_weight(w16, a, b, 0.5).dtype == torch.bfloat16


def test_an_incomplete_layer_is_an_error_not_a_missing_weight():
    parts = [
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", torch.ones(2, 2)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", torch.ones(1, 2)),
    ]
    with pytest.raises(RuntimeError, match="incomplete layers"):
        list(lora.merged(parts, {"model.layers.0.self_attn.q_proj": 1.0}))


def test_a_bad_target_is_one_line_listing_the_models_linear_layers():
    with pytest.raises(ConfigError) as err:
        lora.attach(toy_model(), LoraConfig(rank=8, target_modules=["q_proj", "qkv_proj"]))
    msg = str(err.value)
    assert "\n" not in msg and "'qkv_proj'" in msg
    for name in ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"):
        assert name in msg
    with pytest.raises(ConfigError, match="lm_head.*chunked head"):
        lora.attach(toy_model(), LoraConfig(rank=8, target_modules=["lm_head"]))
    lora.check_targets(toy_model(), ["self_attn.q_proj", "mlp.up_proj"])  # dotted suffixes are names too


def test_base_identity_reads_the_hub_blob_name_and_hashes_other_files(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"weights")
    ident = lora.base_identity(str(local))
    file_digest = hashlib.sha256(b"weights").hexdigest()
    assert ident["sha256"] == hashlib.sha256(f"model.safetensors:{file_digest}\n".encode()).hexdigest()
    hub = tmp_path / "snapshot"
    (tmp_path / "blobs").mkdir()
    hub.mkdir()
    (tmp_path / "blobs" / file_digest).write_bytes(b"weights")
    os.symlink(tmp_path / "blobs" / file_digest, hub / "model.safetensors")
    assert lora.base_identity(str(hub))["sha256"] == ident["sha256"]  # the same file, its digest not recomputed

    other = dict(ident, path="/elsewhere", sha256="f" * 64)
    assert lora.base_problem(ident, dict(ident)) is None and lora.base_problem(None, None) is None
    msg = lora.base_problem(ident, other)
    assert str(local) in msg and "/elsewhere" in msg and ident["sha256"][:16] in msg and "f" * 16 in msg
    assert "full fine-tuning run" in lora.base_problem(None, ident)
    assert "LoRA run" in lora.base_problem(ident, None)


def test_targets_are_checked_from_the_config_alone_before_any_weight_is_read(tmp_path):
    """The architecture from config.json on the meta device: a directory with no weight file at all."""
    from transformers import AutoConfig, Qwen2Config

    from trapo.commands.toy import MODEL_SHAPE

    Qwen2Config(vocab_size=64, **MODEL_SHAPE).save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # nothing to load: no weights exist
    config = AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        lora.check_config_targets(config, ["q_proj", "qkv_proj"])
    msg = str(err.value)
    assert "\n" not in msg and "'qkv_proj' is not a linear layer" in msg and "down_proj" in msg
    with pytest.raises(ConfigError, match="lm_head.*chunked head"):
        lora.check_config_targets(config, ["lm_head"])
    lora.check_config_targets(config, ["self_attn.q_proj", "mlp.up_proj"])


def test_the_policy_checks_targets_before_it_reads_a_weight(tmp_path):
    """Policy refuses a bad target from the model directory's config: its weight file is never opened (the
    directory has none), and DeepSpeed's config is not even read."""
    from transformers import Qwen2Config

    from trapo.commands.toy import MODEL_SHAPE
    from trapo.config import Config
    from trapo.engine.policy import Policy

    Qwen2Config(vocab_size=64, **MODEL_SHAPE).save_pretrained(tmp_path)
    cfg = Config()
    cfg.model.lora = LoraConfig(rank=8, target_modules=["qkv_proj"])
    cfg.train.deepspeed_config = str(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="'qkv_proj' is not a linear layer"):
        Policy(
            str(tmp_path), 1, 0, model=cfg.model, train=cfg.train, rollout=cfg.rollout, loss=None, checkpointing=False
        )
