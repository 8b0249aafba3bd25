"""`make gpu-check`: the acceptance check of a new GPU node, in a time box, one line per check and a report.

    make gpu-kit                      # where the package index is reachable: the wheels, into .gpukit/
    make gpu-check                    # on the node (offline): the checks that tell most first, in the time box
    make gpu-check BUDGET_S=900       # a longer time box: more of the checks planned
    make gpu-check PART=1|2|3|4       # a later run: one part
    make gpu-check ONLY=kill_resume   # a later run: the named checks (the first run's last line names them)
    GPU_CHECK_DRY_RUN=1 make gpu-check  # the same script on CPU, toy and tiny shapes (CI runs it)

First the environment (nvidia-smi, nvcc, torch, CUDA and package versions), printed before anything can
fail; then the kit, installed offline (`pip --no-index --target .gpucheck/site`) as a layer over the
node's own Python, so its torch is the one used (a venv made from that Python, itself perhaps a venv, would
see the base interpreter's packages, not its torch). Each check runs in its own process with a time limit
(processes.py), so one failure does not stop the others.

With no PART it plans the time box (plan.py): each check's GPU time estimated from its shapes, taken in the
order that tells most first (`ORDER`) while the estimates fit `--budget-s` (default plan.BUDGET_S, the kit's
install included); a check still running GRACE_S past the budget is stopped, and the report is rewritten
after each check, so a run cut short still leaves one. The dry run runs every check, times each on this CPU
and ends with the line `time box: <checks> planned in <N> s (budget <B>)`. Parts, each sized to fit the
default budget on one H100-class GPU, for a later run:

1. the doctor (rollout.backend=hf) and `pytest -m gpu`;
2. bench/bench_update_gpu.py at the 1.5B shape: tokens/s, MFU, peak memory against the plan, the
   attention kernel packed rows ran, packing against padding;
3. a bf16 toy run with the hf backend through the `deepspeed` launcher, killed mid-run (SIGKILL) and
   resumed, against an uninterrupted run; two training steps at the 1.5B shape with 512-token answers,
   each phase's time and peak memory against the memory plan (shape_step.py);
4. two training steps at Qwen2.5-Math-7B's shape with rank-32 LoRA adapters on one GPU
   (configs/trapo_1k_3k_lora_1gpu.yaml's model and adapters), each phase's peak against the plan.

The report (report.py) goes to `--report-dir`/<date>-<gpu>[-part<n>].md: by default docs/gpu/ in a clone of the
repository, ./gpu-reports elsewhere, and .gpucheck/reports/ for the dry run (`default_report_dir`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from trapo import runtime
from trapo.commands.gpu_check import plan
from trapo.commands.gpu_check.processes import DEADLINE, shell, tail
from trapo.commands.gpu_check.report import Check, shown, write_report

ROOT = runtime.ROOT
WORK = ROOT / ".gpucheck"
KIT = ROOT / ".gpukit"
SMALL_TOY = [  # the dry run's toy: the test suite's sizes and its shorter warm start (what it checks is the resume)
    "toy.sft_steps=150",
    "toy.labeled=16",
    "toy.unlabeled=48",
    "toy.test=16",
    "train.rollout_batch_size=16",
    "train.update_batch_size=16",
    "selection.warmup_epochs=1",
]


PROBE = """
import importlib.metadata as m
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())
def version(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
    return "missing"
print(", ".join(f"{p} {version(p, p + '-cpu')}" for p in
      ("transformers", "deepspeed", "math-verify", "tokenizers", "accelerate", "vllm")))
"""


GRACE_S = 60  # past the budget, the estimates' error: a check still running then is stopped
# ----------------------------------------------------------------------------- environment and kit


def environment(dry_run: bool, env: dict) -> list[str]:
    """What the node is, printed first: a run that fails still says where it ran."""
    lines = []
    for title, cmd in (
        ("nvidia-smi", "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
        ("nvcc", "nvcc --version | tail -2"),
        ("python", f"{sys.executable} --version"),
    ):
        code, out = shell(cmd, env, 60)
        found = out.strip().replace("\n", "; ")
        lines.append(f"{title}: {found if code == 0 and found else 'not available'}")
    code, out = shell([sys.executable, "-c", PROBE], env, 120)
    lines += out.strip().splitlines()[-2:] if code == 0 else [f"package probe failed: {tail(out, 3)}"]
    for line in lines:
        print(f"  {line}", flush=True)
    return lines


def install_kit(check: Check, env: dict, dry_run: bool) -> None:
    from trapo.commands.gpu_kit import KitError, built_for, needed, verify

    try:
        wheels = verify(KIT)
    except (KitError, OSError) as err:
        if dry_run:
            check.add("kit", True, f"not checked (dry run; {str(err)[:80]})")
            return
        check.add("kit", False, f"{err}; run `make gpu-kit` where the package index is reachable")
        return
    size = sum(w["bytes"] for w in wheels) / 2**20
    node = built_for(KIT)
    made_for = f"made for Python {node['python'] or '?'}, torch {node['torch'] or '?'}"
    if dry_run:  # the kit's wheels are for the node's Python; the dry run uses this checkout's .venv
        figure = f"{len(wheels)} wheels, {size:.1f} MiB, {made_for}, checksums verified (dry run: not installed)"
        check.add("kit", True, figure)
        return
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if node["python"] and node["python"] != python:
        check.add("kit", False, f"{made_for}, this node runs Python {python}: make gpu-kit KIT_PYTHON={python}")
        return
    site = WORK / "site"
    shutil.rmtree(site, ignore_errors=True)
    missing = needed(wheels)  # the node's own copy of a wheel's exact version is kept
    have = ", ".join(f"{w['name']} {w['version']}" for w in wheels if w not in missing) or "none"
    print(f"  kit: {len(missing)} of {len(wheels)} wheels to install ({made_for}); the node has {have}", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--target",
        str(site),
        *(str(KIT / w["file"]) for w in missing),
    ]
    code, out = shell(cmd, env, 300) if missing else (0, "")
    probe = "import deepspeed, math_verify, transformers; print(deepspeed.__version__, transformers.__version__)"
    if code == 0:
        code, out = shell([sys.executable, "-c", probe], env, 300)
    found = " ".join(out.split()[-2:]) if code == 0 else "?"
    figure = f"{len(missing)} of {len(wheels)} wheels ({size:.1f} MiB) installed offline (node has: {have}); "
    torch = _version("torch")
    if node["torch"] and torch != node["torch"]:  # the wheels' torch requirements were checked against the kit's
        figure += f"{made_for}, the node has torch {torch}; "
    check.add("kit", code == 0, figure + f"deepspeed, transformers {found}", tail(out))


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


# ----------------------------------------------------------------------------- checks


def doctor(check: Check, env: dict, dry_run: bool) -> None:
    code, out = shell([sys.executable, "-m", "trapo", "doctor", "rollout.backend=hf"], env, 420)
    summary = next((line for line in out.splitlines() if line.startswith("trapo doctor:")), "no summary")
    failed = [line.strip() for line in out.splitlines() if "FAIL" in line][:3]
    check.add(
        "doctor (rollout.backend=hf)", code == 0, summary + ("; " + " | ".join(failed) if failed else ""), tail(out, 40)
    )


def pytest_gpu(check: Check, env: dict, dry_run: bool) -> None:
    # the doctor and the update benchmark are checks of their own here
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "tests/training/test_gpu.py",
        "-k",
        "not doctor_passes and not update_benchmark",
    ]
    code, out = shell(cmd, env, 480)
    summary = next(
        (line for line in reversed(out.splitlines()) if re.search(r"passed|failed|skipped|error", line)), "no summary"
    )
    ok = code == 0 or (dry_run and code == 5)  # 5: nothing collected/ran (every GPU test skips on CPU)
    check.add("pytest -m gpu", ok, summary.strip("= "), tail(out, 60))


def bench_update(check: Check, env: dict, dry_run: bool) -> None:
    cmd = [sys.executable, "bench/bench_update_gpu.py", *(["--cpu-smoke"] if dry_run else [])]
    code, out = shell(cmd, env, 480)
    keep = ("ours", "full logits", "memory plan", "packed rows ran", "mixed lengths", "peak memory ours")
    lines = [line for line in out.splitlines() if line.startswith(keep)]
    check.add(
        "bench_update_gpu (1.5B shape)" if not dry_run else "bench_update_gpu (tiny shape)",
        code == 0,
        " | ".join(lines) if code == 0 else "failed",
        tail(out, 40),
    )


def _launch(args: list[str], env: dict) -> list[str]:
    from trapo.engine.dist import free_port

    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        "trapo_train.py",
        *args,
    ]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def kill_resume(check: Check, env: dict, dry_run: bool) -> None:
    """Straight 8 steps; a run killed with SIGKILL after step 5 (checkpoint at 4), resumed to 8; compared."""
    out_dir = WORK / "toy-runs"
    shutil.rmtree(out_dir, ignore_errors=True)
    dtype = "float32" if dry_run else "bfloat16"
    common = [
        f"output_dir={out_dir}",
        "rollout.backend=hf",
        f"model.dtype={dtype}",
        "max_steps=8",
        "save_steps=2",
        "progress_bar=false",
        "toy.dir=" + str(WORK / "toy-assets"),
        *(SMALL_TOY if dry_run else []),
    ]
    name, log = f"toy kill and resume (hf, {dtype}, launcher)", []
    started = time.time()
    code, out = shell(_launch([*common, "run_name=straight"], env), env, 300)
    log.append(tail(out, 15))
    if code != 0:
        check.add(name, False, f"the straight run failed ({code})", out)
        return
    # the killed run and the resume together take about one straight run (which also built the toy's assets)
    needed, left = 1.5 * (time.time() - started), DEADLINE[0] - time.time()
    if left < needed:
        check.add(
            name,
            False,
            f"not run to the kill: {left:.0f} s of the time box left after the straight run, the "
            f"kill and the resume need ~{needed:.0f} s; rerun it alone: make gpu-check ONLY=kill_resume",
            out,
        )
        return
    proc = subprocess.Popen(
        _launch([*common, "run_name=killed"], env),
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(_metrics(out_dir / "killed")) < 5 and proc.poll() is None:
        time.sleep(0.2)
    killed_at = len(_metrics(out_dir / "killed"))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    code, out = shell(_launch([*common, "run_name=killed", "resume_from=latest"], env), env, 300)
    log.append(tail(out, 15))
    straight, resumed = _metrics(out_dir / "straight"), _metrics(out_dir / "killed")
    steps_ok = [r["step"] for r in resumed] == list(range(1, 9))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(straight, resumed)]
    rewards = all(a["reward_labeled"] == b["reward_labeled"] for a, b in zip(straight, resumed))
    measured = [r["logprob_diff_rollout_vs_policy"] for r in straight + resumed]
    # a step that trained no token compared nothing (None); a run with no comparison at all fails
    health = max((d for d in measured if d is not None), default=float("inf"))
    resumed_same = max(diffs, default=1.0) < 1e-3 and rewards  # the same answers drawn, the same losses
    ok = code == 0 and steps_ok and resumed_same and health < 5e-2 and 2 <= killed_at < 8
    check.add(
        name,
        ok,
        ("" if killed_at >= 2 else "killed before the first checkpoint (step 2), so nothing was resumed; ")
        + f"killed after step {killed_at}, resumed to {len(resumed)}: max |loss diff| vs straight "
        f"{max(diffs, default=float('nan')):.2e}, labeled rewards equal: {rewards}, "
        f"max logprob_diff_rollout_vs_policy {health:.2e}",
        "\n".join(log),
    )


def shape_step(check: Check, env: dict, dry_run: bool, lora: bool = False) -> None:
    cmd = [
        sys.executable,
        "-m",
        "trapo.commands.gpu_check.shape_step",
        "--work",
        str(WORK / "shape"),
        *(["--dry-run"] if dry_run else []),
        *(["--lora"] if lora else []),
    ]
    code, out = shell(cmd, env, 480)
    result = next((json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")), None)
    title = "7B-shape LoRA training step" if lora else "1.5B-shape training step"
    if code != 0 or result is None:
        check.add(title, False, f"failed ({code})", tail(out, 40))
        return
    timing, peak, plan = result["timing_s"], result.get("peak_gib") or {}, result.get("plan_gib") or {}
    phases = ", ".join(
        f"{k} {timing[k]:.2f} s" + (f" peak {peak[k]:.1f} GiB" if k in peak else "")
        for k in ("rollout", "grading", "update", "weight_push", "step")
        if k in timing
    )
    against = f"; plan: rollout {plan.get('rollout')} GiB, update {plan.get('update')} GiB" if plan else ""
    name = title if not dry_run else f"shape step{' with LoRA' if lora else ''} (tiny shape, dry run)"
    trains = f" ({result['trainable'] / 1e6:.1f}M trainable, ZeRO-{result['zero_stage']})" if lora else ""
    trained, answers = result["trained_sequences"], result["answers"]  # a partial update measures less than one
    check.add(
        name,
        trained == answers,
        f"{result['params'] / 1e9:.2f}B params{trains}, mean answer "
        f"{result['mean_response_tokens']:.0f} tokens, {trained} of {answers} answers trained: {phases}{against}",
        json.dumps(result),
    )


def shape_step_lora(check: Check, env: dict, dry_run: bool) -> None:
    # CHECKS's, not the package's name: an import of the submodule shape_step rebinds that to the module
    CHECKS["shape_step"](check, env, dry_run, lora=True)


PARTS = {1: [doctor, pytest_gpu], 2: [bench_update], 3: [kill_resume, shape_step], 4: [shape_step_lora]}
# The time box's order, what tells most first (plan.ESTIMATES has each one's GPU time): the real loop at a real width,
# the GPU tests, the doctor, the update's throughput, the launcher's kill and resume, the 7B LoRA step.
ORDER = [shape_step, pytest_gpu, doctor, bench_update, kill_resume, shape_step_lora]
CHECKS = {fn.__name__: fn for fn in ORDER}


def names_in(text: str, known, kind: str) -> list[str]:
    """The comma-separated names in `text` (an --only value), each one of `known`: else argparse's error naming
    the unknown ones and listing the `kind`s there are (gpu-check's checks, gpu-bench's variants)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {kind} {unknown or text!r}; the {kind}s: {', '.join(known)}")
    return names


def _check_names(text: str) -> list[str]:
    return names_in(text, CHECKS, "check")


def node_env(dry_run: bool) -> dict:
    """The environment of every check's process: the kit's offline install (.gpucheck/site) first on the path,
    but for the dry run, which runs this checkout's own packages. Makes .gpucheck/."""
    WORK.mkdir(exist_ok=True)
    env = runtime.subprocess_env(PYTHONUNBUFFERED="1")
    site = [] if dry_run else [str(WORK / "site")]
    env["PYTHONPATH"] = os.pathsep.join([*site, env["PYTHONPATH"]])
    return env


def default_report_dir(dry_run: bool) -> Path:
    """docs/gpu/ in a clone of the repository (its reports are the project's record), ./gpu-reports elsewhere;
    the dry run's CPU figures go to .gpucheck/reports/, out of the record."""
    if dry_run:
        return WORK / "reports"
    return ROOT / "docs" / "gpu" if (ROOT / ".git").exists() else Path.cwd() / "gpu-reports"


def run_checks(
    check: Check, fns: list, env: dict, dry_run: bool, deadline: float, write, estimates: dict | None = None
) -> None:
    """Each check in turn, its own failure its finding; one whose estimate (`estimates`, plan.ESTIMATES) no
    longer fits before `deadline` (earlier ones ran long) is skipped, named in the report. `write()` rewrites
    the report after each."""
    for fn in fns:
        estimate = (plan.ESTIMATES if estimates is None else estimates).get(fn.__name__, 30.0)
        left = deadline - time.time()
        if left < 30 or (not dry_run and estimate > left):
            check.add(fn.__name__, False, f"not run: {left:.0f} s of the time box left, estimated {estimate:.0f} s")
            check.failed_checks.add(fn.__name__)
            continue
        DEADLINE[0] = deadline
        started, before = time.perf_counter(), len(check.rows)
        try:
            fn(check, env, dry_run)
        except Exception as err:  # noqa: BLE001 - a check's own failure is its finding; the others run
            check.add(fn.__name__, False, f"{type(err).__name__}: {err}")
        if not all(ok for _, ok, _ in check.rows[before:]):
            check.failed_checks.add(fn.__name__)
        for name, _, _ in check.rows[before:]:
            check.seconds[name], check.estimates[name] = time.perf_counter() - started, estimate
        write()  # a run cut short still leaves a report of what ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, choices=sorted(PARTS), help="one part (default: the time box's plan)")
    parser.add_argument(
        "--only",
        type=_check_names,
        help=f"these checks alone, comma-separated (what an earlier run left): {', '.join(CHECKS)}",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=plan.BUDGET_S,
        help=f"the time box in seconds: the checks planned must fit it by their estimates, the kit's install "
        f"included; one still running {GRACE_S} s past it is stopped (default {plan.BUDGET_S})",
    )
    parser.add_argument(
        "--report-dir",
        type=Path,
        help="where the report is written (default: docs/gpu/ in a clone of the repository, ./gpu-reports "
        "elsewhere; the dry run's: .gpucheck/reports/)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
        help="on CPU with the toy and tiny shapes, every check (also GPU_CHECK_DRY_RUN=1)",
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s:g}: give the time box in seconds, more than 0")
    folder = args.report_dir or default_report_dir(args.dry_run)
    started, began = time.perf_counter(), time.time()
    env = node_env(args.dry_run)
    names = [fn.__name__ for fn in ORDER]
    planned, planned_s = plan.within_budget(["kit", *names], args.budget_s)
    if args.only:
        fns = [CHECKS[n] for n in args.only]
        title, make_args = "only-" + "-".join(args.only), " ONLY=" + ",".join(args.only)
    elif args.part:
        fns, title, make_args = PARTS[args.part], f"part{args.part}", f" PART={args.part}"
    else:  # the dry run runs every check, so CI keeps each one working; the GPU runs the plan
        fns = ORDER if args.dry_run else [fn for fn in ORDER if fn.__name__ in planned]
        title, make_args = "", ""
    if args.budget_s != plan.BUDGET_S:
        make_args += f" BUDGET_S={args.budget_s:g}"
    print(f"gpu-check{' (dry run on CPU)' if args.dry_run else ''}: environment", flush=True)
    env_lines = environment(args.dry_run, env)
    check = Check()
    kit_started = time.perf_counter()
    install_kit(check, env, args.dry_run)
    check.seconds["kit"], check.estimates["kit"] = time.perf_counter() - kit_started, plan.ESTIMATES["kit"]

    def write() -> Path:
        return write_report(check, env_lines, title, make_args, args.dry_run, time.perf_counter() - started, folder)

    run_checks(check, fns, env, args.dry_run, began + args.budget_s + GRACE_S, write)
    path = write()
    failed = sum(not ok for _, ok, _ in check.rows)
    print(f"gpu-check: {len(check.rows) - failed} passed, {failed} failed; report {shown(path)}")
    if not args.part and not args.only:
        print(f"time box: {', '.join(planned)} planned in {planned_s:.0f} s (budget {args.budget_s:g})")
    left_out = [] if args.part or args.only else [fn.__name__ for fn in ORDER if fn not in fns]
    again = [fn.__name__ for fn in ORDER if fn.__name__ in left_out or fn.__name__ in check.failed_checks]
    if again and not args.dry_run:
        print(f"not run or failed here: make gpu-check ONLY={','.join(again)}")
    return 1 if failed else 0
