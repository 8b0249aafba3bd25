"""Policy pieces that need no model."""

import pytest

from trapo.engine.policy import Policy


def test_reference_logprobs_need_a_reference_model():
    policy = Policy.__new__(Policy)  # loss.beta = 0: no reference model was loaded
    policy.engine, policy.ref, policy.lora = object(), None, False
    with pytest.raises(ValueError, match="loaded only when loss.beta > 0"):
        policy.with_logprobs([], "ref_logprobs")


def test_unpushed_maps_fused_engine_parameters_to_checkpoint_names():
    from trapo.engine.vllm_rollout import unpushed

    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "lm_head.weight",
    ]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    full = (
        {"model.embed_tokens.weight", "lm_head.weight"}
        | {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
        | {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")}
    )
    assert unpushed(names, packed, full) == []
    assert unpushed(names, packed, full - {"model.layers.0.self_attn.k_proj.weight"}) == [
        "model.layers.0.self_attn.qkv_proj.weight"
    ]
    assert unpushed(names, packed, full - {"lm_head.weight"}) == ["lm_head.weight"]


def test_stale_cpu_shm_segments_are_removed_and_mapped_ones_kept(tmp_path):
    """vLLM's CPU tensor-parallel segments outlive a run that ends by os._exit; the next run removes them."""
    import mmap

    from trapo.engine.vllm_rollout import remove_stale_cpu_shm

    stale, live = tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1"
    for path in (stale, live):
        path.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live run's segment
        assert remove_stale_cpu_shm(str(tmp_path)) == [str(stale)]
        assert live.exists() and not stale.exists()
