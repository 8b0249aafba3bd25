"""Which checks fit the time box: each check's GPU time estimated from its shapes, taken in the order that
tells most first while the estimates fit the budget.

A new node's time before it goes into service is short (a reservation, a slot between jobs): so
`make gpu-check` with no PART plans one run of `--budget-s` seconds (default BUDGET_S), the kit's install
included, and leaves the rest to a later run (PART=n, ONLY=...). These are estimates from a simple cost
model (constants below, each with what it stands for, fitted to the GPUs the check has run on:
docs/gpus.md), not measurements; the reports in docs/gpu/ hold what each run measured beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BUDGET_S = 480  # the default time box: the kit and the checks that tell most, up to the update benchmark

# The cost model of one H100-class GPU, fitted to the slowest one the check has run on (docs/gpus.md): a
# faster GPU finishes early, a slower one is cut at the time box and says what it left.
PROCESS_S = 15.0  # a fresh Python process importing torch, transformers and DeepSpeed and starting CUDA
TRAINER_S = 10.0  # a trainer's start beyond that: ZeRO-3 init, the toy's assets read, grading workers
TOY_BUILD_S = 20.0  # the toy's tokenizer, model and data, built once per check that trains it
PARAM_S = 1.2e-8  # per parameter of a shape step: random init on the host, ZeRO-3 partitioning on load
BF16_FLOPS = 300e12  # achieved by a ZeRO-3 update with checkpointing, recompute counted (bench_update_gpu)
LAYER_STEP_S = 1.75e-3  # one decoder layer of one eager transformers decode step: launch-bound, ~width-free
DISK_BYTES_S = 1.0e9  # safetensors written and read back (the random model of a shape step)
TOY_STEP_S = 1.5  # one toy training step on the GPU (a tiny model: launch-bound, shape-independent)
KIT_S = 15.0  # pip installing the kit's wheels offline, then importing them once


@dataclass(frozen=True)
class Shape:
    """What a shape step trains: parameters, layers, sequences per step and their lengths."""

    params: float
    layers: int
    sequences: int = 512  # 64 questions x 8 answers
    prompt: int = 64  # the toy's questions are short
    answer: int = 512
    hf_max_batch: int = 256  # rollout.hf_max_batch: rows generated at once


R1_1P5B = Shape(params=1.78e9, layers=28)  # DeepSeek-R1-Distill-Qwen-1.5B's widths, untied head
MATH_7B = Shape(params=7.6e9, layers=28)  # Qwen2.5-Math-7B's


def generation_s(shape: Shape) -> float:
    """hf-backend rollouts: each round decodes `answer` steps of every layer (random weights rarely stop)."""
    rounds = math.ceil(shape.sequences / shape.hf_max_batch)
    return rounds * shape.answer * shape.layers * LAYER_STEP_S


def update_s(shape: Shape, trainable_share: float = 1.0) -> float:
    """One update: 2 x params x tokens for the forward, again for the recompute of checkpointed layers, and
    the backward's 4 x params x tokens (2 with LoRA's frozen base: no weight gradients, only activations')."""
    tokens = shape.sequences * (shape.prompt + shape.answer)
    backward = 2 + 2 * trainable_share
    return (2 + 2 + backward) * shape.params * tokens / BF16_FLOPS


def shape_step_s(shape: Shape, lora: bool = False) -> float:
    """Build and save the random model, load it, two training steps."""
    io = 2 * 2 * shape.params / DISK_BYTES_S  # bf16 written, then read
    setup = PROCESS_S + TRAINER_S + PARAM_S * shape.params + io
    return setup + 2 * (generation_s(shape) + update_s(shape, 0.0 if lora else 1.0))


def toy_runs_s(runs: int, steps: int) -> float:
    """`runs` trainer processes of `steps` toy steps each, the toy built by the first."""
    return TOY_BUILD_S + runs * (PROCESS_S + TRAINER_S + steps * TOY_STEP_S)


def bench_update_s(seqs: int = 32, length: int = 2048, steps: int = 3) -> float:
    """bench_update_gpu: two heads x (one warm-up + `steps`) updates, then packed vs padded at mixed lengths."""
    shape = Shape(params=R1_1P5B.params, layers=R1_1P5B.layers, sequences=seqs, prompt=length // 4, answer=length)
    setup = PROCESS_S + PARAM_S * R1_1P5B.params + 2 * R1_1P5B.params * 2 / DISK_BYTES_S
    return setup + 4 * (steps + 1) * update_s(shape)


# check name -> estimated GPU seconds; the order is the order of what tells most first
ESTIMATES = {
    "kit": KIT_S,
    # the real loop at a real width: ZeRO-3, checkpointing, packed rows' kernel, hf generation, bf16, the plan
    "shape_step": shape_step_s(R1_1P5B),
    # the varlen kernel against per-sequence attention; the toy in bf16 straight and resumed (3 runs x 4 steps)
    "pytest_gpu": 10 + toy_runs_s(3, 4),
    # versions, NCCL collectives, a two-step trial run on a shrunken model, the memory plan
    "doctor": PROCESS_S + TRAINER_S + TOY_BUILD_S + 2 * TOY_STEP_S,  # its trial run is in its own process
    "bench_update": bench_update_s(),
    "kill_resume": toy_runs_s(3, 8),
    "shape_step_lora": shape_step_s(MATH_7B, lora=True),
}


def bench_update_only_s(checkpointing: bool = True, seqs: int = 32, length: int = 2048, steps: int = 3) -> float:
    """bench_update_gpu --only-ours: one warm-up + `steps` updates of our path (no recompute without checkpointing)."""
    shape = Shape(params=R1_1P5B.params, layers=R1_1P5B.layers, sequences=seqs, prompt=length // 4, answer=length)
    setup = PROCESS_S + PARAM_S * R1_1P5B.params + 2 * R1_1P5B.params * 2 / DISK_BYTES_S
    update = update_s(shape) * (1.0 if checkpointing else 6 / 8)  # 6 x params x tokens instead of 8
    return setup + (steps + 1) * update


PROFILE_S = 20.0  # the profiler's recording and summary of one update and one decode stretch
DECODE_STRETCH = 32  # tokens per row of the profiled decode stretch (shape_step.DECODE_STRETCH)
VARIANT_TOKENS = 128  # forced tokens per row of each decode path's measure (shape_step.VARIANT_TOKENS)
GRAPH_SPEEDUP = 5.0  # the captured paths' decode steps against eager's: the target, not a measurement
CAPTURE_S = 15.0  # capturing a path's shapes (rows buckets x cache spans), each a forward
COMPILE_S = 120.0  # inductor compiling the 1.5B step for each shape it meets
FUSE_COMPILE_S = 30.0  # inductor compiling the three fused elementwise kernels, forward and backward


def decode_paths_s(paths: dict[str, float]) -> float:
    """Each path decodes the round's rows twice for VARIANT_TOKENS tokens; `paths`: path -> its speed-up over
    eager's launch-bound steps."""
    once = generation_s(Shape(params=R1_1P5B.params, layers=R1_1P5B.layers, answer=VARIANT_TOKENS))
    return sum(2 * once / speedup + (CAPTURE_S if speedup > 1 else 0.0) for speedup in paths.values())


TRL_START_S = 10.0  # TRL's own imports (datasets, pandas, pyarrow) and GRPOTrainer's set-up, beyond a process's


def trl_step_s(shape: Shape, build_model: bool = False) -> float:
    """TRL's GRPOTrainer at `shape` (bench/peers/trl_job.py): the random model read (built first when no shape step
    of the same call left it), two steps, each one generation batch of every answer (one round of decoding: TRL
    generates them all at once) and one update (no recompute of old log-probabilities: generation and update are
    aligned, TRL's own rule)."""
    written = 2 * shape.params / DISK_BYTES_S  # bf16
    build = PROCESS_S + PARAM_S * shape.params + written if build_model else 0.0
    one_round = Shape(shape.params, shape.layers, shape.sequences, shape.prompt, shape.answer, shape.sequences)
    return build + PROCESS_S + TRL_START_S + written + 2 * (generation_s(one_round) + update_s(shape))


# `make gpu-bench`'s variants -> estimated GPU seconds, in the order they run: the real loop profiled, the update
# without checkpointing and with persistent parameters, the captured decode path's GPU tests, the update with
# checkpointing, TRL's step on the model step_profiled left (a call without step_profiled builds it first:
# trl_step_s(R1_1P5B, build_model=True)), then the update and decode candidates
BENCH_ESTIMATES = {
    "kit": KIT_S,
    # the two steps' rollouts at eager's speed: the bound for a GPU where the capture falls back
    "step_profiled": shape_step_s(R1_1P5B)
    + PROFILE_S
    + 2 * generation_s(Shape(params=R1_1P5B.params, layers=R1_1P5B.layers, answer=DECODE_STRETCH))  # warm, profiled
    + decode_paths_s({"eager": 1.0, "static": 1.0, "cuda_graph": GRAPH_SPEEDUP}),
    "update_no_checkpointing": bench_update_only_s(checkpointing=False),
    "update_persistent": bench_update_only_s(checkpointing=True),
    # pytest's start, the toy model on the GPU, the paths' captures of a small model, twice
    "decode_captured": PROCESS_S + 2 * CAPTURE_S,
    "update_checkpointing": bench_update_only_s(checkpointing=True),
    "trl_step": trl_step_s(R1_1P5B),
    "update_fused": bench_update_only_s(checkpointing=True) + FUSE_COMPILE_S,
    "update_micro_32k": bench_update_only_s(checkpointing=True),
    "decode_compile": PROCESS_S
    + TRAINER_S
    + PARAM_S * R1_1P5B.params
    + COMPILE_S
    + decode_paths_s({"compile": GRAPH_SPEEDUP}),
}


def within_budget(order: list[str], budget: float = BUDGET_S, estimates: dict | None = None) -> tuple[list[str], float]:
    """The longest prefix of `order` (skipping none) whose `estimates` (ESTIMATES) fit `budget`: (names, planned
    seconds)."""
    estimates = ESTIMATES if estimates is None else estimates
    planned, total = [], 0.0
    for name in order:
        if total + estimates[name] > budget:
            break
        planned.append(name)
        total += estimates[name]
    return planned, total
