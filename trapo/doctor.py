"""Checks before a run, without GPUs or weights.

    python -m trapo.doctor --plan --config configs/trapo_1k_3k.yaml [key=value ...] --gpus 8 --gpu-memory-gb 80

--plan: per-GPU memory at start-up, during rollouts and in the update (trapo/memory_plan.py, where every
formula and its source is stated), on the given cards and on 80 and 141 GiB cards.
Exit status: 0 fits, 1 does not fit (the problems name the setting to change), 2 bad input (one line).

Another check is one more flag in `main` and one more `*_mode(args) -> int` function.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trapo.config import ConfigError, load_config
from trapo.memory_plan import GiB, Plan, memory_plan, model_arch

CARDS = (80, 141)  # GiB: H100 / A100 80 GB, H200 141 GB
TITLES = {
    "start-up": "start-up: vLLM built beside the ZeRO-3 partitions, before step 1",
    "rollout": "rollouts, from step 2 (Adam moments exist)",
    "update": "update: vLLM asleep (level 2)",
}


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage too)
        raise BadInput(message)


def format_plan(plan: Plan, title: str) -> str:
    a, kv = plan.arch, plan.kv
    lines = [
        f"memory plan: {title} on {plan.world} x {plan.gpu_bytes / GiB:g} GiB, per GPU",
        f"model {a.name} ({a.params:,} parameters; {a.source}); largest micro-batch {plan.tokens} tokens",
    ]
    for phase, items in plan.phases.items():
        lines.append(f"{TITLES[phase]:<70} {'GiB':>8}")
        for i in items:
            note = "" if i.counted or i.name.startswith("  of which") or ": offloaded" in i.name else " (not at once)"
            lines.append(f"  {i.name + note:<68} {i.bytes / GiB:8.2f}")
        lines.append(f"  {'peak':<68} {plan.peak(phase) / GiB:8.2f}")
    lines.append(
        f"KV cache: {kv['bytes_per_token']:,} B per token, {kv['sequences_held']} sequences of "
        f"{kv['sequence_tokens']} tokens held, {kv['sequences_needed']} started at once per engine"
    )
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"verdict: {verdict} on {plan.world} x {plan.gpu_bytes / GiB:g} GiB")
    lines += [f"  problem: {p}" for p in plan.problems] + [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def plan_mode(args: argparse.Namespace) -> int:
    if args.gpus is None or args.gpus < 1:
        raise BadInput(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpu_memory_gb is None or not args.gpu_memory_gb > 0:
        raise BadInput(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb}")
    cfg = load_config(args.config, args.overrides)
    try:
        ds_config = json.loads(Path(cfg.train.deepspeed_config).read_text())
    except (OSError, ValueError) as err:
        raise BadInput(f"train.deepspeed_config {cfg.train.deepspeed_config}: cannot read JSON ({err})") from None
    arch = model_arch(cfg.model.path)
    plan = memory_plan(cfg, args.gpus, round(args.gpu_memory_gb * GiB), arch, ds_config)
    print(format_plan(plan, args.config))
    cards = []
    for gb in CARDS:
        other = memory_plan(cfg, args.gpus, gb * GiB, arch, ds_config)
        peak = max(other.peak(p) for p in other.phases) / GiB
        cards.append(f"{args.gpus} x {gb} GiB: {'fits' if other.fits else 'does NOT fit'} (peak {peak:.1f} GiB)")
    print("other cards: " + "; ".join(cards))
    if not plan.fits:
        print(f"trapo.doctor: does not fit: {plan.problems[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m trapo.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="the per-GPU memory plan of a config")
    parser.add_argument("--config", help="an experiment YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the config")
    parser.add_argument("--gpus", type=int, help="world size: GPUs in all, one rank each")
    parser.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU, GiB (an 80 GB H100: 80)")
    try:
        args = parser.parse_args(argv)
        if args.plan:
            return plan_mode(args)
        raise BadInput("choose a check: --plan")
    except (BadInput, ConfigError) as err:
        print(f"trapo.doctor: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
