"""The memory plan of rollout.placement separate against figures worked out by hand."""

import json
import os

import pytest

from trapo.config import ConfigError, load_config
from trapo.engine.memory_plan import GiB, memory_plan, model_arch
from trapo.engine.memory_plan_separate import separate_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEPARATE = ["rollout.backend=hf", "rollout.placement=separate", "rollout.max_staleness=1"]


def plans(world, gib, *overrides):
    cfg = load_config(os.path.join(ROOT, "configs", "trapo_1k_3k.yaml"), [*SEPARATE, *overrides])
    with open(os.path.join(ROOT, cfg.train.deepspeed_config)) as f:
        ds = json.load(f)
    arch = model_arch(cfg.model.path)
    return cfg, arch, ds, separate_plan(cfg, world, gib * GiB, arch, ds)


def test_rollout_gpus_hold_the_engine_and_its_kv_cache_only():
    cfg, arch, ds, plan = plans(8, 80, "rollout.ranks=4", "rollout.hf_max_batch=64")
    items = {i.name: i.bytes for i in plan.phases["rollout"]}
    # Qwen2.5-Math-7B in bf16: 2 B x 7,615,616,512 parameters, whole on every rollout GPU
    assert items["hf generation: the engine's whole model (2 B/param)"] == 2 * 7_615_616_512
    # KV cache: 2 (k, v) x 28 layers x 4 kv heads x 128 x 2 B = 57,344 B per token; 64 sequences (hf_max_batch,
    # below the 64 / 4 x 8 = 128 each rollout GPU starts) of 1,024 prompt + 8,192 response tokens
    assert items["hf generation: KV cache (64 sequences x 9216 tokens)"] == 64 * 9216 * 57_344
    assert plan.kv["sequences_needed"] == 128 and plan.rollout_ranks == 4 and plan.placement == "separate"
    assert not any("param partition" in name or "Adam" in name for name in items)  # nothing of the trainer's


def test_training_gpus_are_the_colocated_plan_on_the_others_without_an_engine():
    cfg, arch, ds, plan = plans(8, 80, "rollout.ranks=4")
    colocated = memory_plan(cfg, 4, 80 * GiB, arch, ds)
    assert plan.phases["update"] == colocated.phases["update"]
    assert plan.phases["start-up"] == colocated.phases["start-up"]
    assert not any(i.name.startswith("hf generation") for i in plan.phases["start-up"] + plan.phases["update"])


def test_a_rollout_gpu_that_overflows_names_the_fix():
    *_, plan = plans(8, 80, "rollout.ranks=4", "rollout.hf_max_batch=256")
    assert not plan.fits
    assert plan.problems[-1].startswith("rollout GPU: needs") and "lower rollout.hf_max_batch" in plan.problems[-1]
    with pytest.raises(ConfigError, match="rollout.placement separate, 2 of them rollout GPUs: 6 GPUs"):
        plans(8, 80, "rollout.ranks=2")
    with pytest.raises(ConfigError, match="no GPU left to train"):
        plans(4, 80, "rollout.ranks=4")


def test_doctor_prints_the_rollout_gpu_and_the_training_gpu():
    from trapo.commands.doctor import format_plan

    *_, plan = plans(8, 80, "rollout.ranks=4", "rollout.hf_max_batch=64")
    text = format_plan(plan, "trapo_1k_3k")
    assert "rollout.placement separate: the last 4 GPUs hold only the engine" in text
    assert "rollout GPU: the hf engine and its KV cache only" in text and "training GPU, update" in text
    assert "verdict: fits on 8 x 80 GiB" in text
