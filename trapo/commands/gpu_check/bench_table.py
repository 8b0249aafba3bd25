"""docs/benchmarks.md's GPU table: written from a `make gpu-bench` figures file (`<date>-<gpu>-bench.json`,
beside its report), never typed in.

    python -m trapo gpu-bench --docs-from docs/gpu/<date>-<gpu>-bench.json   # rewrite the block from a file

A run whose report goes into a clone's docs/gpu/ rewrites the block itself. NeMo-RL's published figure
stands beside ours for scale only: another model, other lengths, another engine, sixteen GPUs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from trapo import runtime

BLOCK = "gpu-bench"
PAGE = runtime.ROOT / "docs" / "benchmarks.md"
REPORTS = runtime.ROOT / "docs" / "gpu"
JOB = "64 questions x 8 answers forced to 512 tokens, 1.5B shape, random weights, bf16, ZeRO-3, one GPU"
NEMO_RL = (
    "For scale only, NeMo-RL's performance summary (docs.nvidia.com/nemo/rl, About > Performance) lists "
    "1,581 tokens/s/GPU end to end for Llama-3.1-8B GRPO on 16 H100s, on-policy: a model about 4.5 times "
    "ours, other prompt and response lengths, vLLM generating and Megatron training across nodes; not a "
    "ratio to ours."
)


def _gib(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f} GiB"


def render(figures: dict | None, source: str = "") -> str:
    """The block's Markdown for a figures file's contents (None: no GPU run yet)."""
    if not figures:
        return (
            "No `make gpu-bench` run on a GPU has been recorded yet: its run writes this table (the end-to-end "
            "step, the rollout by decode path, the update by variant, each beside the memory plan).\n\n" + NEMO_RL
        )
    rows = [f"| {figures['gpu']}, {figures['date']} ({JOB}) | tokens/s | notes |", "|---|---|---|"]
    step = figures.get("step")
    if step:
        peak, plan = step.get("peak_gib") or {}, step.get("plan_gib") or {}
        peaks = ", ".join(f"{k} {_gib(v)} (plan {plan.get(k)})" for k, v in peak.items())
        rows.append(
            f"| end to end: one training step | {step['step_tokens_per_s']:,.0f} per GPU | {step['step_s']:.1f} s a "
            f"step; {step.get('checkpointing') or 'checkpointing not said'}; peaks {peaks} |"
        )
        rows.append(
            f"| rollout, decoding {step['decoding']} | {step['rollout_tokens_per_s']:,.0f} | "
            f"logprob_diff_rollout_vs_policy {step['logprob_diff_rollout_vs_policy']:.2e} |"
        )
    decode = figures.get("decode") or {}
    eager = (decode.get("eager") or {}).get("tokens_per_s")
    for path, r in decode.items():
        if "error" in r:
            rows.append(f"| decode stretch, {path} | | {r['error'][:120]} |")
            continue
        against = f"{r['tokens_per_s'] / eager:.2f}x eager; " if eager and path != "eager" else ""
        rows.append(
            f"| decode stretch, {path} | {r['tokens_per_s']:,.0f} | {against}first call {r['first_call_s']:.1f} s; "
            f"log-prob gap {r['logprob_gap']:.2e} |"
        )
    for variant in (figures.get("update") or {}).values():
        plan = variant.get("plan_gib")
        ratio = f" (measured/plan {variant['peak_gib'] / plan:.2f})" if plan else ""
        rows.append(
            f"| update, {variant['what']} | {variant['tokens_per_s']:,.0f} | MFU {variant['mfu']:.1%}; peak "
            f"{_gib(variant['peak_gib'])}{ratio} |"
        )
    trl = figures.get("trl")
    if trl:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in trl["phases_s"].items())
        against = trl.get("ours_over_trl")
        versus = ", ".join(f"{k} {r:.2f}x" for k, r in against.items()) if against else "no step of ours in the call"
        rows.append(f"| TRL {trl.get('version') or ''} GRPOTrainer, the same job | | {phases}; ours/TRL {versus} |")
    head = f"From `{source}`.\n\n" if source else ""
    return head + "\n".join(rows) + "\n\n" + NEMO_RL


def newest(folder: Path = REPORTS) -> Path | None:
    """The newest GPU (not dry-run) figures file in `folder`."""
    files = sorted(folder.glob("*-bench.json"))
    files = [f for f in files if not json.loads(f.read_text()).get("dry_run")]
    return files[-1] if files else None


def write(figures_path: Path | None, page: Path = PAGE) -> None:
    """Rewrite `page`'s block from `figures_path` (None: the no-run text)."""
    from trapo.commands.readme import replace_block

    figures = json.loads(figures_path.read_text()) if figures_path else None
    source = ""
    if figures_path:
        where = figures_path.resolve()
        source = str(where.relative_to(runtime.ROOT)) if where.is_relative_to(runtime.ROOT) else where.name
    page.write_text(replace_block(page.read_text(), BLOCK, render(figures, source)))
