"""The memory plan of rollout.placement separate against figures worked out by hand."""

import json
import os

import pytest

from trapo.config import ConfigError, load_config
from trapo.engine.memory_plan import GiB, checkpointing_needed, memory_plan
from trapo.engine.memory_plan_separate import separate_plan
from trapo.engine.model_shapes import model_arch

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
    assert (
        items["hf generation: KV cache (64 sequences x 9216 tokens, static: 64 rows x 9216 positions)"]
        == 64 * 9216 * 57_344
    )
    assert plan.kv["sequences_needed"] == 128 and plan.rollout_ranks == 4 and plan.placement == "separate"
    assert not any("param partition" in name or "Adam" in name for name in items)  # nothing of the trainer's


def test_training_gpus_are_the_colocated_plan_on_the_others_without_an_engine():
    cfg, arch, ds, plan = plans(8, 80, "rollout.ranks=4")
    colocated = memory_plan(cfg, 4, 80 * GiB, arch, ds)
    assert plan.phases["update"] == colocated.phases["update"]
    assert plan.phases["start-up"] == colocated.phases["start-up"]
    assert not any(i.name.startswith("hf generation") for i in plan.phases["start-up"] + plan.phases["update"])


def test_auto_checkpointing_is_decided_on_the_training_gpus():
    cfg, arch, ds, plan = plans(8, 80, "rollout.ranks=4", "model.gradient_checkpointing=auto")
    decided = checkpointing_needed(cfg, 4, 80 * GiB, arch, ds)  # what the trainer asks on its 4 training ranks
    assert plan.checkpointing == decided
    assert decided != checkpointing_needed(cfg, 8, 80 * GiB, arch, ds)  # not the whole world's update


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
    assert "rollout GPU: the engine and its KV cache only" in text and "training GPU, update" in text
    assert "verdict: fits on 8 x 80 GiB" in text


def test_a_vllm_rollout_gpu_holds_its_share_of_the_card_and_the_training_gpus_no_engine():
    cfg, arch, ds, plan = plans(8, 80, "rollout.ranks=4", "rollout.backend=vllm", "rollout.gpu_memory_utilization=0.9")
    items = {i.name: i for i in plan.phases["rollout"]}
    share = items["vLLM: rollout.gpu_memory_utilization 0.9 x card"]
    assert share.bytes == -(-9 * 80 * GiB // 10) and share.counted
    assert (
        sum(i.bytes for i in plan.phases["rollout"] if i.counted)
        == share.bytes + items[next(n for n in items if n.startswith("reserve"))].bytes
    )  # the engine's share and the reserve: nothing of the trainer's
    # weights 2 B x 7,615,616,512 in the share; its KV cache: what the share leaves, 57,344 B a token
    assert items["  of which weights"].bytes == 2 * 7_615_616_512 and not items["  of which weights"].counted
    kv = items["  of which KV cache"].bytes
    assert (
        kv
        == share.bytes
        - sum(items[f"  of which {w}"].bytes for w in ("weights", "profile activations"))
        - items["  of which non-torch, CUDA graphs (assumed)"].bytes
    )
    # 1,024 + 8,192 tokens a sequence; the rollout GPU's share of the round: 64 / 4 questions x 8
    assert plan.kv["sequences_held"] == kv // (57_344 * 9216) and plan.kv["sequences_needed"] == 128 and plan.fits
    hf = plans(8, 80, "rollout.ranks=4")[3]  # the training GPUs: the same plan as with hf (no engine, no vLLM asleep)
    assert plan.phases["update"] == hf.phases["update"] and plan.phases["start-up"] == hf.phases["start-up"]
    *_, starved = plans(8, 80, "rollout.ranks=4", "rollout.backend=vllm", "rollout.gpu_memory_utilization=0.2")
    assert not starved.fits and "raise rollout.gpu_memory_utilization" in starved.problems[-1]
