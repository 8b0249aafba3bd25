"""`make gpu-bench`: where a GPU's time goes in a training step, in one time-boxed run, with a report.

    make gpu-bench                       # on the node, after make gpu-check (the same kit, installed offline)
    make gpu-bench BUDGET_S=900          # a longer time box
    GPU_CHECK_DRY_RUN=1 make gpu-bench   # the same script on CPU, toy and tiny shapes (the test suite runs it)

At the 1.5B shape (DeepSeek-R1-Distill-Qwen-1.5B's widths, random weights, the hf backend, 64 questions x 8
answers forced to 512 tokens, bf16, ZeRO-3 on one GPU), each variant a process of its own, planned within
`--budget-s` by plan.BENCH_ESTIMATES (the kit's install included):

    step_profiled             two training steps (rollout.hf_decoding and model.gradient_checkpointing auto,
                              as a user's run: CUDA graphs, and checkpointing where the plan needs it): the second's
                              rollout tokens/s, update and step seconds and each phase's peak beside the
                              memory plan's; torch-profiler summaries of the first step's update and of one
                              decode stretch (gpu_check/profile.py: the longest kernels, the share of wall
                              time outside kernels) and that stretch's tokens/s; then the round's rows
                              decoded by the eager, static and cuda_graph paths (decode_variants.py):
                              tokens/s, start-up, log-prob gap to a plain forward, each against eager
    update_checkpointing      bench/bench_update_gpu.py, our path: update tokens/s, MFU (6 x params x tokens),
                              peak against the plan, with gradient checkpointing (the default)
    update_no_checkpointing   the same without it (where memory allows: the row says what ran out)
    update_fused              with checkpointing and model.fused_kernels (compiled RMSNorm, SwiGLU, rotary)
    update_persistent         with checkpointing and every ZeRO-3 parameter persistent: on one GPU its
                              partition is the whole model, so this is what gathering and releasing cost
    decode_compile            the round's rows decoded through torch.compile (reduce-overhead), no training

The dry run runs every variant on CPU and ends with `one call: <variants> planned in <N> s (limit <B>)`: the
plan for the GPU, by the estimates. The report goes to `--report-dir`/<date>-<gpu>-bench.md (docs/gpu/ in
a clone; the dry run's to .gpucheck/reports/), its figures as data beside it (.json), from which
docs/benchmarks.md's GPU table is written (bench_table.py: by the run itself when it reports into a clone's
docs/gpu/, else `--docs-from <file>.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from trapo.commands import gpu_check
from trapo.commands.gpu_check import bench_table, plan
from trapo.commands.gpu_check.processes import shell, tail
from trapo.commands.gpu_check.profile import lines as profile_lines
from trapo.commands.gpu_check.report import Check, shown, write_report


def _json_line(out: str) -> dict | None:
    return next((json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")), None)


SHAPE_STEP = [sys.executable, "-m", "trapo.commands.gpu_check.shape_step", "--work", str(gpu_check.WORK / "bench")]
STEP_DECODINGS = "eager,static,cuda_graph"  # the compiled path runs in a process of its own (decode_compile)
ROLLOUT_TARGET = 32_000  # response tokens/s at the 1.5B shape on one H100/H200: 5x the eager path's 6,400


def decode_rows(check: Check, decodings: dict, dry_run: bool) -> None:
    """One row per decode path: tokens/s, start-up, log-prob gap, and its speed against eager's."""
    eager = decodings.get("eager", {}).get("tokens_per_s")
    check.figures.setdefault("decode", {}).update(decodings)
    for name, r in decodings.items():
        title = f"decode: {name}" + (" (tiny shape, dry run)" if dry_run else "")
        if "error" in r:  # on CPU the captured paths must be refused: that is the dry run's pass
            refused = dry_run and "CUDA device" in r["error"]
            check.add(
                title, refused, ("refused on CPU, as it must be: " if refused else "") + r["error"], json.dumps(r)
            )
            continue
        against = f", {r['tokens_per_s'] / eager:.2f}x eager" if eager and name != "eager" else ""
        figure = (
            f"{r['tokens_per_s']:,.0f} tokens/s{against}; first call {r['first_call_s']:.1f} s; "
            f"log-prob gap to a plain forward {r['logprob_gap']:.2e}"
        )
        check.add(title, True, figure, json.dumps(r))


def step_profiled(check: Check, env: dict, dry_run: bool) -> None:
    # what a user's run gets by default: auto decoding and auto checkpointing (the memory plan's choice)
    args = ["--profile", "--decodings", STEP_DECODINGS, "--checkpointing", "auto", *(["--dry-run"] if dry_run else [])]
    code, out = shell([*SHAPE_STEP, *args], env, 600)
    result = _json_line(out)
    name = "1.5B-shape step" if not dry_run else "shape step (tiny shape, dry run)"
    checkpointing = next(
        (line.split("] ", 1)[-1] for line in out.splitlines() if "gradient checkpointing:" in line), ""
    )
    if code != 0 or result is None or "profile" not in result:
        check.add(name, False, f"failed ({code})", tail(out, 40))
        return
    timing, peak, planned = result["timing_s"], result.get("peak_gib") or {}, result.get("plan_gib") or {}
    tokens = result["answers"] * (result["mean_response_tokens"] or 0)
    phases = ", ".join(
        f"{k} {timing[k]:.2f} s" + (f" (peak {peak[k]:.1f} GiB, plan {planned.get(k)})" if k in peak else "")
        for k in ("rollout", "update", "step")
        if k in timing
    )
    rate, checkpointing = tokens / timing["rollout"], result.get("checkpointing")
    check.figures["step"] = {
        "decoding": result["decoding"],
        "checkpointing": checkpointing,
        "rollout_tokens_per_s": round(rate, 1),
        "step_tokens_per_s": round(tokens / timing["step"], 1),
        "update_s": timing.get("update"),
        "step_s": timing["step"],
        "peak_gib": peak,
        "plan_gib": planned,
        "logprob_diff_rollout_vs_policy": result["logprob_diff_rollout_vs_policy"],
    }
    target = "" if dry_run else f" ({rate / ROLLOUT_TARGET:.2f} of the {ROLLOUT_TARGET:,} target)"
    check.add(
        name,
        result["trained_sequences"] == result["answers"],
        f"decoding {result['decoding']}, {checkpointing or 'gradient checkpointing: not said'}: rollout "
        f"{rate:,.0f} response tokens/s{target}, step "
        f"{tokens / timing['step']:,.0f}; {phases}; "
        f"logprob_diff_rollout_vs_policy {result['logprob_diff_rollout_vs_policy']:.2e}",
        json.dumps(result),
    )
    profile = result["profile"]
    for key, title in (("update", "profile: the first step's update"), ("decode", "profile: a decode stretch")):
        summary = profile[key]
        figure = f"{summary['wall_s']:.2f} s, outside kernels {summary['outside_share']:.0%}; top: " + "; ".join(
            f"{r['name'][:60]} {r['share']:.0%}" for r in summary["top"][:3]
        )
        if key == "decode":
            figure += f"; {profile['decode_tokens_per_s']:,.0f} tokens/s"
        check.add(title, True, figure, "\n".join(profile_lines(summary, title, top=10)))
    decode_rows(check, result["decodings"], dry_run)


def update_figures(row: str, plan_line: str) -> dict:
    """bench_update_gpu's row for our path ("ours (chunked head)  tokens/s  MFU%  peak  s/update") and its plan
    line ("... X GiB planned, Y GiB measured ...") as numbers; nan where the run had no GPU."""
    tokens_per_s, mfu, peak, seconds = row.split()[-4:]
    planned = re.search(r"([\d.]+) GiB planned", plan_line)
    return {
        "tokens_per_s": float(tokens_per_s),
        "mfu": float(mfu.rstrip("%")) / 100,
        "peak_gib": float(peak),
        "plan_gib": float(planned[1]) if planned else None,
        "update_s": float(seconds),
    }


UPDATE_VARIANTS = {  # variant -> (bench_update_gpu flags, what its row says)
    "update_checkpointing": ([], "gradient checkpointing"),
    "update_no_checkpointing": (["--no-checkpointing"], "no gradient checkpointing"),
    "update_fused": (["--fused-kernels"], "gradient checkpointing, fused kernels"),
    "update_persistent": (["--persistent-params"], "gradient checkpointing, parameters persistent"),
}


def _update(check: Check, env: dict, dry_run: bool, variant: str) -> None:
    flags, what = UPDATE_VARIANTS[variant]
    cmd = [sys.executable, "bench/bench_update_gpu.py", "--only-ours", *(["--cpu-smoke"] if dry_run else [])]
    code, out = shell([*cmd, *flags], env, 480)
    row = next((line for line in out.splitlines() if line.startswith("ours")), "")
    plan_line = next((line for line in out.splitlines() if line.startswith("memory plan")), "")
    name = f"update, {what}" + ("" if not dry_run else " (tiny shape, dry run)")
    failed = "out of memory" if "OutOfMemoryError" in out else f"failed ({code})"
    if code == 0 and row:
        check.figures.setdefault("update", {})[variant] = {"what": what, **update_figures(row, plan_line)}
    check.add(
        name, code == 0 and bool(row), f"{' '.join(row.split())} | {plan_line}" if code == 0 else failed, tail(out)
    )


def update_checkpointing(check: Check, env: dict, dry_run: bool) -> None:
    _update(check, env, dry_run, "update_checkpointing")


def update_no_checkpointing(check: Check, env: dict, dry_run: bool) -> None:
    _update(check, env, dry_run, "update_no_checkpointing")


def update_fused(check: Check, env: dict, dry_run: bool) -> None:
    _update(check, env, dry_run, "update_fused")


def update_persistent(check: Check, env: dict, dry_run: bool) -> None:
    _update(check, env, dry_run, "update_persistent")


def decode_compile(check: Check, env: dict, dry_run: bool) -> None:
    """The compiled path alone (its compile time is its own risk): no training, the same rows and tokens. On
    CPU (dry run) its refusal is the row: torch.compile's CUDA graphs need a GPU."""
    code, out = shell(
        [*SHAPE_STEP, "--steps", "0", "--decodings", "compile", *(["--dry-run"] if dry_run else [])], env, 600
    )
    result = _json_line(out)
    if code != 0 or result is None:
        check.add("decode: compile", False, f"failed ({code})", tail(out, 40))
        return
    decode_rows(check, result["decodings"], dry_run)


ORDER = [step_profiled, update_checkpointing, update_no_checkpointing, update_fused, update_persistent, decode_compile]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo gpu-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=plan.BUDGET_S, help=f"the time box (default {plan.BUDGET_S})")
    parser.add_argument("--report-dir", type=Path, help="where the report goes (default: as gpu-check's)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
        help="on CPU with the toy and tiny shapes, every variant (also GPU_CHECK_DRY_RUN=1)",
    )
    parser.add_argument(
        "--docs-from", type=Path, help="only rewrite docs/benchmarks.md's GPU table from this figures file (.json)"
    )
    args = parser.parse_args(argv)
    if args.docs_from:
        if not args.docs_from.is_file():
            parser.error(f"--docs-from {args.docs_from}: no such figures file (a gpu-bench run writes <report>.json)")
        bench_table.write(args.docs_from)
        print(f"gpu-bench: docs/benchmarks.md's GPU table written from {shown(args.docs_from)}")
        return 0
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s:g}: give the time box in seconds, more than 0")
    folder = args.report_dir or gpu_check.default_report_dir(args.dry_run)
    started, began = time.perf_counter(), time.time()
    env = gpu_check.node_env(args.dry_run)
    names = [fn.__name__ for fn in ORDER]
    planned, planned_s = plan.within_budget(["kit", *names], args.budget_s, plan.BENCH_ESTIMATES)
    fns = ORDER if args.dry_run else [fn for fn in ORDER if fn.__name__ in planned]
    make_args = f" BUDGET_S={args.budget_s:g}" if args.budget_s != plan.BUDGET_S else ""
    print(f"gpu-bench{' (dry run on CPU)' if args.dry_run else ''}: environment", flush=True)
    env_lines = gpu_check.environment(args.dry_run, env)
    check = Check()
    kit_started = time.perf_counter()
    gpu_check.install_kit(check, env, args.dry_run)
    check.seconds["kit"], check.estimates["kit"] = time.perf_counter() - kit_started, plan.BENCH_ESTIMATES["kit"]

    def write() -> Path:
        seconds = time.perf_counter() - started
        return write_report(check, env_lines, "bench", make_args, args.dry_run, seconds, folder, "gpu-bench")

    deadline = began + args.budget_s + gpu_check.GRACE_S
    gpu_check.run_checks(check, fns, env, args.dry_run, deadline, write, plan.BENCH_ESTIMATES)
    path = write()
    if not args.dry_run and folder.resolve() == bench_table.REPORTS.resolve():  # a clone's docs: its table too
        bench_table.write(path.with_suffix(".json"))
    failed = sum(not ok for _, ok, _ in check.rows)
    print(f"gpu-bench: {len(check.rows) - failed} passed, {failed} failed; report {shown(path)}")
    print(f"one call: {', '.join(planned)} planned in {planned_s:.0f} s (limit {args.budget_s:g})")
    return 1 if failed else 0
