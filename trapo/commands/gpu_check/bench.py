"""`make gpu-bench`: where a GPU's time goes in a training step, in one time-boxed run, with a report.

    make gpu-bench                       # on the node, after make gpu-check (the same kit, installed offline)
    make gpu-bench BUDGET_S=900          # a longer time box
    make gpu-bench ONLY=step_profiled,trl_step   # a later call: these variants alone, in the order below
    GPU_CHECK_DRY_RUN=1 make gpu-bench   # the same script on CPU, toy and tiny shapes (the test suite runs it)
    GPU_CHECK_DRY_RUN=1 GPU_BENCH_TRL=1 make gpu-bench   # the dry run with TRL's tiny step too

At the 1.5B shape (DeepSeek-R1-Distill-Qwen-1.5B's widths, random weights, the hf backend, 64 questions x 8
answers forced to 512 tokens, bf16, ZeRO-3 on one GPU), each variant a process of its own, planned within
`--budget-s` by plan.BENCH_ESTIMATES (the kit's install included):

    step_profiled             two training steps (every auto setting as a user's run has it: CUDA graphs, and
                              the memory plan's checkpointing, LM-head chunk, persistence and rows): the second's
                              rollout tokens/s, update and step seconds and each phase's peak beside the
                              memory plan's; torch-profiler summaries of the first step's update and of one
                              decode stretch (gpu_check/profile.py: the longest kernels, the share of wall
                              time outside kernels) and that stretch's tokens/s; then the round's rows
                              decoded by the eager, static and cuda_graph paths (decode_variants.py):
                              tokens/s, start-up, log-prob gap to a plain forward, each against eager
    update_no_checkpointing   bench/bench_update_gpu.py, our path: update tokens/s, MFU (6 x params x tokens),
                              peak against the plan, without gradient checkpointing (where memory allows: the
                              row says what ran out), ZeRO-3 gathering and releasing each module
    update_persistent         with checkpointing and every ZeRO-3 parameter persistent: on one GPU its
                              partition is the whole model, so against update_checkpointing this is what
                              gathering and releasing cost (the memory plan's choice where the model fits)
    decode_captured           the captured decode path's GPU tests (tests/training/test_gpu.py): replays equal to
                              the static steps, a failed capture restoring the stream and auto decoding eagerly
    update_checkpointing      with checkpointing, parameters gathered and released per module
    trl_step                  TRL's GRPOTrainer (bench/peers/trl_job.py at bench/peers/requirements.txt's pin,
                              from the kit) on the model and questions step_profiled used: transformers
                              generation (vLLM is not carried), bf16, gradient checkpointing, 64 x 8 answers
                              forced to 512 tokens (min_new_tokens), each step one generation batch of every
                              answer and one update in micro-batches of TRL_MICRO_BATCH rows; two steps, the
                              second timed: its rollout, update and step seconds, and ours/TRL for each against
                              step_profiled's second step in the same call (the row says when there was none)
    update_fused              with checkpointing and model.fused_kernels (compiled RMSNorm, SwiGLU, rotary)
    update_micro_32k          with checkpointing and micro-batches of 32,768 tokens (twice the configs')
    decode_compile            the round's rows decoded through torch.compile (reduce-overhead), no training

Phases, on both sides: the rollout is the generation; the update is ours' update phase (log-probabilities,
the loss, its backward, the optimizer step) and on TRL's side the step after generating and scoring (the
loss's forward and backward over the micro-batches, the optimizer step); the step is the whole step. TRL
loads the bf16 checkpoint as it does by default, so its weights and AdamW states are bf16; ours keeps fp32
master weights and moments (ZeRO-3's bf16 mode).

The default 480 s plans the kit, step_profiled (a user's run: the memory plan's choices of checkpointing, LM-head
chunk, parameter persistence and rows), update_no_checkpointing, update_persistent and decode_captured (by the
estimates): what decides the update's MFU and whether the captured path holds; the rest (update_checkpointing,
trl_step, fused kernels, 32K micro-batches, compile) waits for a second call. A GPU run's last line names
what was left or failed as the second call that reruns it, e.g. `make gpu-bench ONLY=step_profiled,trl_step`
(step_profiled comes with trl_step: the ratios need both in one call; alone, trl_step builds the same model
itself).

The dry run runs every variant on CPU (trl_step only with GPU_BENCH_TRL=1, TRL from this Python or from
`make bench-peers`'s .venv-peers: TRL's tiny step takes longer than the suite should spend on it; the captured
decode paths are refused on CPU, which is their pass) and ends with `one call: <variants> planned in <N> s
(limit <B>)`: the plan for the GPU, by the estimates. The report goes to
`--report-dir`/<date>-<gpu>-bench[-only-<variants>].md (docs/gpu/ in a clone; the dry run's to
.gpucheck/reports/), its figures as data beside it (.json), from which docs/benchmarks.md's GPU table is
written (bench_table.py: by the run itself when it reports into a clone's docs/gpu/, else `--docs-from`).
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

ANSWERS = 8  # per question, as shape_step.ANSWERS (importing that submodule would rebind gpu_check.shape_step)
TRL_JOB = "bench/peers/trl_job.py"
TRL_MICRO_BATCH = 32  # rows per TRL forward and backward: 32 x ~520 tokens, about ours' micro_batch_tokens=16384
PEERS_PYTHON = gpu_check.ROOT / ".venv-peers" / "bin" / "python"  # make bench-peers's TRL, for the dry run
PHASES = ("step", "rollout", "update")  # compared, ours/TRL
NOT_RUN = "not run: GPU_BENCH_TRL=1 runs it (TRL from this Python or make bench-peers's)"  # the dry run's default


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
        if r.get("graph_skips"):  # torch.compile's path: steps inductor ran without the graphs it was asked for
            figure += f"; {r['graph_skips']} steps ran without CUDA graphs"
        check.add(title, True, figure, json.dumps(r))


def step_profiled(check: Check, env: dict, dry_run: bool) -> None:
    # what a user's run gets by default: auto decoding and auto checkpointing (the memory plan's choice)
    args = ["--profile", "--decodings", STEP_DECODINGS, "--checkpointing", "auto", *(["--dry-run"] if dry_run else [])]
    code, out = shell([*SHAPE_STEP, *args], env, 600)
    result = _json_line(out)
    name = "1.5B-shape step" if not dry_run else "shape step (tiny shape, dry run)"
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
    step_rate = tokens / timing["step"]
    check.figures["step"] = {
        "decoding": result["decoding"],
        "checkpointing": checkpointing,
        "rollout_tokens_per_s": round(rate, 1),
        "step_tokens_per_s": round(step_rate, 1),
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
        f"{rate:,.0f} response tokens/s{target}, step {step_rate:,.0f}; {phases}; "
        f"logprob_diff_rollout_vs_policy {result['logprob_diff_rollout_vs_policy']:.2e}",
        json.dumps(result),
    )
    check.results["step_profiled"] = result  # trl_step's model, questions and the figures it compares with
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
    "update_micro_32k": (["--tokens", "32768"], "gradient checkpointing, micro-batches of 32,768 tokens"),
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


def _update_variant(variant: str):
    """The check of one UPDATE_VARIANTS entry, named after it (ORDER, --only and the plan go by the name)."""

    def run(check: Check, env: dict, dry_run: bool) -> None:
        _update(check, env, dry_run, variant)

    run.__name__ = run.__qualname__ = variant
    return run


UPDATE = {variant: _update_variant(variant) for variant in UPDATE_VARIANTS}


def decode_captured(check: Check, env: dict, dry_run: bool) -> None:
    """The captured decode path's GPU tests (tests/training/test_gpu.py): CUDA-graph replays equal to the static
    steps bit for bit and following eager decoding, and a capture that fails leaving the caller's stream current
    and auto decoding eagerly. On CPU (dry run) they skip, which is their pass."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/training/test_gpu.py"]
    code, out = shell([*cmd, "-k", "captured_decode or capture_that_fails"], env, 300)
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"passed|failed|skipped|error", line)), "")
    passed = code == 0 and ("skipped" in summary if dry_run else "2 passed" in summary)
    check.add("decode: captured path's GPU tests", passed, summary.strip("= ") or f"failed ({code})", tail(out, 60))


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


def trl_phases(result: dict) -> dict:
    """TRL's timed step (trl_job's last: the first warms up) as phases, in seconds, with its scoring."""
    return {
        "rollout": result["generate"][-1],
        "update": result["update"][-1],
        "step": result["step"][-1],
        "scoring": result["generate_score"][-1] - result["generate"][-1],
    }


def our_phases(result: dict) -> dict:
    """step_profiled's timed step (shape_step's second) as phases, in seconds."""
    return {k: result["timing_s"][k] for k in PHASES if k in result["timing_s"]}


def ratios(ours: dict, trl: dict) -> dict:
    """ours/TRL per phase (below 1: ours is faster), for the phases both measured."""
    return {k: ours[k] / trl[k] for k in PHASES if k in ours and trl.get(k)}


def trl_figure(result: dict, ours: dict | None, why_not: str = "") -> str:
    """trl_step's row: TRL's phases (`result`: trl_job's JSON line) and ours/TRL against step_profiled's `result`
    (`ours`), or why there is no comparison."""
    trl, tokens = trl_phases(result), result["answers"] * result["mean_length"][-1]
    peak = f", peak {result['peak_gib'][-1]:.1f} GiB" if result.get("peak_gib") else ""
    text = (
        f"TRL {result.get('version', '?')}: rollout {trl['rollout']:.2f} s ({tokens / trl['rollout']:,.0f} response "
        f"tokens/s), update {trl['update']:.2f} s, step {trl['step']:.2f} s (scoring {trl['scoring']:.2f} s), mean "
        f"answer {result['mean_length'][-1]:.0f} tokens{peak}; "
    )
    if ours is None:
        return text + f"ours/TRL: none, {why_not}"
    pairs = ", ".join(f"{k} {r:.2f}x" for k, r in ratios(our_phases(ours), trl).items())
    mean = ours.get("mean_response_tokens")
    return text + f"ours/TRL: {pairs} (below 1: ours faster; ours' mean answer {mean or 0:.0f} tokens)"


def _trl_python(env: dict, dry_run: bool) -> str | None:
    """The Python that has TRL: this one (on the node, the kit's), else for the dry run make bench-peers's."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('trl') is None)"
    candidates = [sys.executable, *([str(PEERS_PYTHON)] if dry_run and PEERS_PYTHON.exists() else [])]
    return next((python for python in candidates if shell([python, "-c", probe], env, 120)[0] == 0), None)


def trl_step(check: Check, env: dict, dry_run: bool) -> None:
    name = "TRL step (tiny shape, dry run)" if dry_run else "TRL GRPOTrainer step (1.5B shape, transformers generation)"
    if dry_run and env.get("GPU_BENCH_TRL") != "1":
        check.add(name, True, NOT_RUN)
        return
    python = _trl_python(env, dry_run)
    if python is None:
        where = "here nor in .venv-peers (make bench-peers)" if dry_run else "here: make gpu-kit without KIT_TRL=0"
        check.add(name, False, f"TRL is not importable {where}")
        return
    work, ours = gpu_check.WORK / "bench-trl", check.results.get("step_profiled")
    model = ours if ours and Path(ours["model_dir"]).exists() else None
    if model is None:  # no step_profiled in this call: the same random model, built the same way
        cmd = [sys.executable, "-m", "trapo.commands.gpu_check.shape_step", "--work", str(work), "--model-only"]
        code, out = shell([*cmd, *(["--dry-run"] if dry_run else [])], env, 300)
        model = _json_line(out) if code == 0 else None
        if model is None:
            check.add(name, False, f"the model's build failed ({code})", tail(out, 40))
            return
    questions, tokens = (16, 32) if dry_run else (64, 512)  # as shape_step's
    cmd = [python, TRL_JOB, "--model", model["model_dir"], "--train", model["train_file"], "--all-rows"]
    cmd += ["--tokens", str(tokens), "--steps", "2", "--questions", str(questions), "--n", str(ANSWERS)]
    cmd += ["--micro-batch", str(TRL_MICRO_BATCH), "--gradient-checkpointing", "--out", str(work / "run")]
    code, out = shell([*cmd, *([] if dry_run else ["--bf16"])], env, 600)
    result = next((json.loads(line) for line in reversed(out.splitlines()) if line.startswith('{"side"')), None)
    if code != 0 or result is None:
        check.add(name, False, f"failed ({code})", tail(out, 40))
        return
    if result["mean_length"][-1] != tokens:  # a comparison only at the forced length
        check.add(name, False, f"TRL's answers averaged {result['mean_length'][-1]} tokens, not {tokens}", tail(out))
        return
    failed = "step_profiled" in check.failed_checks  # its model is still the same; its figures are not a step's
    why_not = "step_profiled failed" if failed else "step_profiled did not run"
    why_not += " in this call (make gpu-bench ONLY=step_profiled,trl_step)"
    compared = None if failed or ours is None else ratios(our_phases(ours), trl_phases(result))
    check.figures["trl"] = {"version": result.get("version"), "phases_s": trl_phases(result), "ours_over_trl": compared}
    check.add(name, True, trl_figure(result, None if failed else ours, why_not), tail(out, 40))


ORDER = [
    step_profiled,
    UPDATE["update_no_checkpointing"],
    UPDATE["update_persistent"],
    decode_captured,
    UPDATE["update_checkpointing"],
    trl_step,
    UPDATE["update_fused"],
    UPDATE["update_micro_32k"],
    decode_compile,
]
VARIANTS = {fn.__name__: fn for fn in ORDER}


def _variant_names(text: str) -> list[str]:
    return gpu_check.names_in(text, VARIANTS, "variant")


def rerun(left_out: set[str], failed: set[str]) -> list[str]:
    """The variants a second call takes, in ORDER: those left out of the plan or failed, with step_profiled
    beside trl_step (its ratios need both in one call)."""
    names = left_out | failed
    if "trl_step" in names:
        names.add("step_profiled")
    return [n for n in VARIANTS if n in names]


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
    parser.add_argument(
        "--only",
        type=_variant_names,
        help=f"these variants alone, comma-separated, run in the order listed here: {', '.join(VARIANTS)}",
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
    if args.only:  # ORDER's order whatever the listing: trl_step compares with a step_profiled run before it
        fns = [fn for fn in ORDER if fn.__name__ in args.only]
        title, make_args = "bench-only-" + "-".join(fn.__name__ for fn in fns), " ONLY=" + ",".join(args.only)
    else:  # the dry run runs every variant, so the suite keeps each one working; the GPU runs the plan
        fns = ORDER if args.dry_run else [fn for fn in ORDER if fn.__name__ in planned]
        title, make_args = "bench", ""
    make_args += f" BUDGET_S={args.budget_s:g}" if args.budget_s != plan.BUDGET_S else ""
    print(f"gpu-bench{' (dry run on CPU)' if args.dry_run else ''}: environment", flush=True)
    env_lines = gpu_check.environment(args.dry_run, env)
    check = Check()
    kit_started = time.perf_counter()
    gpu_check.install_kit(check, env, args.dry_run)
    check.seconds["kit"], check.estimates["kit"] = time.perf_counter() - kit_started, plan.BENCH_ESTIMATES["kit"]

    def write() -> Path:
        seconds = time.perf_counter() - started
        return write_report(check, env_lines, title, make_args, args.dry_run, seconds, folder, "gpu-bench")

    deadline = began + args.budget_s + gpu_check.GRACE_S
    gpu_check.run_checks(check, fns, env, args.dry_run, deadline, write, plan.BENCH_ESTIMATES)
    path = write()
    # a whole run reporting into a clone's docs: its table too (a call with ONLY holds a part of the figures)
    if not args.dry_run and not args.only and folder.resolve() == bench_table.REPORTS.resolve():
        bench_table.write(path.with_suffix(".json"))
    failed = sum(not ok for _, ok, _ in check.rows)
    print(f"gpu-bench: {len(check.rows) - failed} passed, {failed} failed; report {shown(path)}")
    if not args.only:
        print(f"one call: {', '.join(planned)} planned in {planned_s:.0f} s (limit {args.budget_s:g})")
    again = rerun(set() if args.only else {n for n in names if n not in planned}, check.failed_checks)
    if again and not args.dry_run:
        print(f"not run or failed here: make gpu-bench ONLY={','.join(again)}")
    return 1 if failed else 0
