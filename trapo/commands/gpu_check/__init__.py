"""`make gpu-check`: what works on a GPU machine, in minutes, with one line per check and a report.

    make gpu-kit                      # where the package index is reachable: the wheels, into .gpukit/
    make gpu-check                    # on the GPU machine (offline): one call, the checks that tell most first
    make gpu-check PART=1|2|3|4       # a second call: one part
    make gpu-check ONLY=kill_resume   # a second call: the named checks (the first call's last line names them)
    GPU_CHECK_DRY_RUN=1 make gpu-check  # the same script on CPU, toy and tiny shapes (CI runs it)

First the environment (nvidia-smi, nvcc, torch, CUDA and package versions), printed before anything can
fail; then the kit, installed offline (`pip --no-index --target .gpucheck/site`) as a layer over the
machine's own Python, so its torch is the one used (a venv made from that Python, itself a venv, would
see the base interpreter's packages, not its torch). Each check runs in its own process with a time
limit, so one failure does not stop the others (the dry run forks its Python checks from a pre-imported
parent, trapo/commands/fork_server/: its CPU times leave out their imports).

With no PART it plans one device call (plan.py): each check's GPU time estimated from its shapes, taken
in the order that tells most first (`ORDER`) while the estimates fit plan.LIMIT_S (480 s, the kit's install
included); the report is rewritten after each check. The dry run runs every check, times each on this CPU
and ends with the line `one call: <checks> planned in <N> s (limit 480)`. Parts (at most ~9 minutes each on
one H100), for a second call:

1. the doctor (rollout.backend=hf) and `pytest -m gpu`;
2. bench/bench_update_gpu.py at the 1.5B shape: tokens/s, MFU, peak memory against the plan, the
   attention kernel packed rows ran, packing against padding;
3. a bf16 toy run with the hf backend through the `deepspeed` launcher, killed mid-run (SIGKILL) and
   resumed, against an uninterrupted run; two training steps at the 1.5B shape with 512-token answers,
   each phase's time and peak memory against the memory plan (shape_step.py);
4. two training steps at Qwen2.5-Math-7B's shape with rank-32 LoRA adapters on one GPU
   (configs/trapo_1k_3k_lora_1gpu.yaml's model and adapters), each phase's peak against the plan.

The report goes to docs/gpu/<date>-<gpu>[-part<n>].md (and to $OUT, where the device tool collects files).
"""

from __future__ import annotations

import argparse
import datetime
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


class Check:
    """One line per check, kept for the report."""

    def __init__(self):
        self.rows: list[tuple[str, bool, str]] = []
        self.logs: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # row name -> seconds its check took here
        self.estimates: dict[str, float] = {}  # row name -> its check's GPU estimate (plan.ESTIMATES)
        self.failed_checks: set[str] = set()  # check functions (ORDER's names) with a failed or skipped row

    def add(self, name: str, ok: bool, figure: str, log: str = "") -> None:
        self.rows.append((name, ok, figure))
        if log:
            self.logs[name] = log
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {figure}", flush=True)


PART_BUDGET = 510  # seconds a part may run: a device call lasts 10 minutes, the kit install included
CALL_BUDGET = 540  # seconds the planned call may run before a check is cut: the report must get back
# ----------------------------------------------------------------------------- environment and kit


def environment(dry_run: bool, env: dict) -> list[str]:
    """What the machine is, printed first: a failed call still says where it ran."""
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
    from trapo.commands.gpu_kit import KitError, needed, verify

    try:
        wheels = verify(KIT)
    except (KitError, OSError) as err:
        if dry_run:
            check.add("kit", True, f"not checked (dry run; {str(err)[:80]})")
            return
        check.add("kit", False, f"{err}; run `make gpu-kit` where the package index is reachable")
        return
    size = sum(w["bytes"] for w in wheels) / 2**20
    if dry_run:  # the kit's wheels are for Python 3.12; the dry run uses this checkout's .venv
        check.add("kit", True, f"{len(wheels)} wheels, {size:.1f} MiB, checksums verified (dry run: not installed)")
        return
    site = WORK / "site"
    shutil.rmtree(site, ignore_errors=True)
    missing = needed(wheels)  # the image's own copy of a wheel's exact version is kept
    have = ", ".join(f"{w['name']} {w['version']}" for w in wheels if w not in missing) or "none"
    print(f"  kit: {len(missing)} of {len(wheels)} wheels to install; the image has {have}", flush=True)
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
    figure = f"{len(missing)} of {len(wheels)} wheels ({size:.1f} MiB) installed offline (image has: {have}); "
    check.add("kit", code == 0, figure + f"deepspeed, transformers {found}", tail(out))


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
            f"not run to the kill: {left:.0f} s of the call left after the straight run, the "
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
    shape_step(check, env, dry_run, lora=True)


PARTS = {1: [doctor, pytest_gpu], 2: [bench_update], 3: [kill_resume, shape_step], 4: [shape_step_lora]}
# One call's order, what tells most first (plan.ESTIMATES has each one's GPU time): the real loop at a real width,
# the GPU tests, the doctor, the update's throughput, the launcher's kill and resume, the 7B LoRA step.
ORDER = [shape_step, pytest_gpu, doctor, bench_update, kill_resume, shape_step_lora]
CHECKS = {fn.__name__: fn for fn in ORDER}


def _check_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check {unknown or text!r}; the checks: {', '.join(CHECKS)}")
    return names


# ----------------------------------------------------------------------------- report


def report(check: Check, env_lines: list[str], title: str, make_args: str, dry_run: bool, seconds: float) -> Path:
    gpu = next((line for line in env_lines if line.startswith("nvidia-smi:")), "")
    name = "cpu-dry-run" if dry_run else re.sub(r"[^a-z0-9]+", "-", gpu.split(":", 1)[-1].split(",")[0].lower())
    name = name.strip("-") or "unknown-gpu"
    stem = f"{datetime.date.today().isoformat()}-{name}" + (f"-{title}" if title else "")
    note = " (GPU_CHECK_DRY_RUN=1: CPU, toy and tiny shapes; not GPU figures)" if dry_run else ""
    lines = [
        f"# GPU check {stem}",
        "",
        f"`make gpu-check{make_args}`{note}, {seconds / 60:.1f} min. Written by trapo/commands/gpu_check.",
        "",
        "## Environment",
        "",
        "```",
        *env_lines,
        "```",
        "",
        "## Checks",
        "",
        "| check | result | seconds (GPU estimate) | figures |",
        "|---|---|---|---|",
    ]
    for n, ok, fig in check.rows:
        took = check.seconds.get(n)
        timing = f"{took:.0f} ({check.estimates[n]:.0f})" if took is not None and n in check.estimates else ""
        lines.append(f"| {n} | {'pass' if ok else 'FAIL'} | {timing} | {fig.replace('|', '/')} |")
    for n, log in check.logs.items():
        lines += ["", f"### {n}", "", "```", log, "```"]
    folder = WORK / "reports" if dry_run else ROOT / "docs" / "gpu"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    if os.environ.get("OUT"):  # the device tool brings back what is under $OUT
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    return path


def run_checks(check: Check, fns: list, env: dict, dry_run: bool, deadline: float, write) -> None:
    """Each check in turn, its own failure its finding; one whose estimate no longer fits before `deadline`
    (earlier ones ran long) is skipped, named in the report. `write()` rewrites the report after each."""
    for fn in fns:
        estimate = plan.ESTIMATES.get(fn.__name__, 30.0)
        left = deadline - time.time()
        if left < 30 or (not dry_run and estimate > left):
            check.add(fn.__name__, False, f"not run: {left:.0f} s of the call left, estimated {estimate:.0f} s")
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
        write()  # a call cut short still brings back what ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, choices=sorted(PARTS), help="one part (default: the one-call plan)")
    parser.add_argument(
        "--only",
        type=_check_names,
        help=f"these checks alone, comma-separated (what an earlier call left): {', '.join(CHECKS)}",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
        help="on CPU with the toy and tiny shapes, every check (also GPU_CHECK_DRY_RUN=1)",
    )
    args = parser.parse_args(argv)
    started, began = time.perf_counter(), time.time()
    WORK.mkdir(exist_ok=True)
    site = WORK / "site"
    path = [str(site)] if not args.dry_run else []
    env = runtime.subprocess_env(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([*path, env["PYTHONPATH"]])
    names = [fn.__name__ for fn in ORDER]
    planned, planned_s = plan.one_call(["kit", *names])
    if args.only:
        fns, budget = [CHECKS[n] for n in args.only], PART_BUDGET
        title, make_args = "only-" + "-".join(args.only), " ONLY=" + ",".join(args.only)
    elif args.part:
        fns, title, make_args, budget = PARTS[args.part], f"part{args.part}", f" PART={args.part}", PART_BUDGET
    else:  # the dry run runs every check, so CI keeps each one working; the GPU runs the plan
        fns = ORDER if args.dry_run else [fn for fn in ORDER if fn.__name__ in planned]
        title, make_args, budget = "", "", CALL_BUDGET
    print(f"gpu-check{' (dry run on CPU)' if args.dry_run else ''}: environment", flush=True)
    env_lines = environment(args.dry_run, env)
    check = Check()
    kit_started = time.perf_counter()
    install_kit(check, env, args.dry_run)
    check.seconds["kit"], check.estimates["kit"] = time.perf_counter() - kit_started, plan.ESTIMATES["kit"]

    def write() -> Path:
        return report(check, env_lines, title, make_args, args.dry_run, time.perf_counter() - started)

    run_checks(check, fns, env, args.dry_run, began + budget, write)
    path = write()
    failed = sum(not ok for _, ok, _ in check.rows)
    print(f"gpu-check: {len(check.rows) - failed} passed, {failed} failed; report {path.relative_to(ROOT)}")
    if not args.part and not args.only:
        print(f"one call: {', '.join(planned)} planned in {planned_s:.0f} s (limit {plan.LIMIT_S})")
    left_out = [] if args.part or args.only else [fn.__name__ for fn in ORDER if fn not in fns]
    again = [fn.__name__ for fn in ORDER if fn.__name__ in left_out or fn.__name__ in check.failed_checks]
    if again and not args.dry_run:
        print(f"not run or failed here: make gpu-check ONLY={','.join(again)}")
    return 1 if failed else 0
