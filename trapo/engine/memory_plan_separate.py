"""The memory plan of `rollout.placement: separate` (docs/async-rollouts.md): the last `rollout.ranks` GPUs hold
a rollout engine and its KV cache only, the others train under ZeRO-3 with no engine.

Built from the colocated plan's own arithmetic (trapo/engine/memory_plan.py), so both count alike:
- training GPUs: the colocated plan's start-up and update on `world - rollout.ranks` GPUs; no rollout phase
  (they never generate), so nothing moves to host memory and no engine shares their memory;
- rollout GPUs: with hf, the engine's whole weights, its KV cache for the sequences each rollout rank starts
  at once (its share of the round's questions x G, at most rollout.hf_max_batch), the prefill and sampler
  activations, and the reserve; with vLLM, its share of the card (rollout.gpu_memory_utilization: weights,
  profiled activations, CUDA graphs and the KV cache within it) and the reserve, the KV cache's sequences
  against the rollout rank's share of the round. Weights pushed to it arrive bucket by bucket through host
  memory (trapo/engine/rollout_link.py), not as a second copy on the GPU.
"""

from __future__ import annotations

import dataclasses
import math

from trapo.config import Config, ConfigError
from trapo.engine.memory_plan import Plan, memory_plan, without_engine
from trapo.engine.model_shapes import Arch

SEPARATE_TITLES = {  # trapo doctor --plan's phase titles for this placement
    "start-up": "training GPU, start-up: the ZeRO-3 partitions, no engine",
    "rollout": "rollout GPU: the engine and its KV cache only",
    "update": "training GPU, update",
}


def separate_plan(cfg: Config, world: int, gpu_bytes: int, arch: Arch, ds_config: dict | None = None) -> Plan:
    """The plan for `cfg` with rollout.placement separate on `world` GPUs of `gpu_bytes` each: phases
    "start-up" and "update" (a training GPU) and "rollout" (a rollout GPU)."""
    r = cfg.rollout
    trainers = world - r.ranks
    if trainers < 1:
        raise ConfigError(f"{world} GPUs with rollout.ranks={r.ranks}: no GPU left to train; use more GPUs")
    hf = r.backend == "hf"
    # the training GPUs hold no engine: the colocated arithmetic without one (hf's plan, whose rollout is dropped)
    try:
        training = memory_plan(without_engine(cfg), trainers, gpu_bytes, arch, ds_config)
    except ConfigError as err:  # the training GPUs' count is what the user sets through rollout.ranks
        raise ConfigError(f"rollout.placement separate, {r.ranks} of them rollout GPUs: {err}") from None
    # the rollout GPUs' engine: the engine's items of a colocated plan on one GPU with a rollout rank's questions
    questions = math.ceil(cfg.train.rollout_batch_size / r.ranks)
    engine_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, rollout_batch_size=questions, update_batch_size=questions)
    )
    engine = memory_plan(engine_cfg, 1, gpu_bytes, arch, ds_config)
    engine_items = ("hf generation", "reserve") if hf else ("vLLM", "  of which", "reserve")
    kept = [i for i in engine.phases["rollout"] if i.name.startswith(engine_items)]
    rollout = [
        dataclasses.replace(i, name=i.name.replace("the whole model gathered", "the engine's whole model"))
        for i in kept
    ]
    gib = gpu_bytes / 2**30
    problems = [p for p in training.problems if not p.startswith("rollout:")]
    peak = sum(i.bytes for i in rollout if i.counted)
    kv = {**engine.kv, "sequences_needed": questions * r.n}
    if peak > gpu_bytes:
        fix = "lower rollout.hf_max_batch" if hf else "lower rollout.gpu_memory_utilization"
        problems.append(f"rollout GPU: needs {peak / 2**30:.1f} GiB of {gib:.1f} GiB: {fix}, or raise rollout.ranks")
    elif not hf and kv["sequences_held"] < 1:
        problems.append(
            f"rollout GPU: vLLM's share of {gib:.1f} GiB (rollout.gpu_memory_utilization {r.gpu_memory_utilization:g}) "
            "leaves no KV cache after the weights: raise rollout.gpu_memory_utilization (the card is the engine's)"
        )
    phases = {"start-up": training.phases["start-up"], "rollout": rollout, "update": training.phases["update"]}
    tail = dict(placement="separate", rollout_ranks=r.ranks, choices=training.choices)  # the training GPUs' choices
    return Plan(arch, world, gpu_bytes, training.tokens, phases, kv, problems, training.warnings, **tail)
