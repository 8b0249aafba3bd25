"""The GPU check's report: one row per check (`Check`), written as Markdown into `--report-dir` after each
check, so a run cut short still leaves what ran."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path


class Check:
    """One line per check, kept for the report."""

    def __init__(self):
        self.rows: list[tuple[str, bool, str]] = []
        self.logs: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # row name -> seconds its check took here
        self.estimates: dict[str, float] = {}  # row name -> its check's GPU estimate (plan.ESTIMATES)
        self.failed_checks: set[str] = set()  # check functions (ORDER's names) with a failed or skipped row
        self.figures: dict = {}  # measured figures as data (gpu-bench), written beside the report as JSON
        self.results: dict[str, dict] = {}  # check function -> what it measured, for a later check to compare

    def add(self, name: str, ok: bool, figure: str, log: str = "") -> None:
        self.rows.append((name, ok, figure))
        if log:
            self.logs[name] = log
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {figure}", flush=True)


def write_report(
    check: Check,
    env_lines: list[str],
    title: str,
    make_args: str,
    dry_run: bool,
    seconds: float,
    folder: Path,
    command: str = "gpu-check",
) -> Path:
    """`check`'s rows and logs under the node's environment, as `folder`/<date>-<gpu>[-<title>].md, and its
    figures as data beside it (.json) where it has any; the report's path. command: the make target that ran
    (gpu-check, gpu-bench)."""
    gpu = next((line for line in env_lines if line.startswith("nvidia-smi:")), "")
    name = "cpu-dry-run" if dry_run else re.sub(r"[^a-z0-9]+", "-", gpu.split(":", 1)[-1].split(",")[0].lower())
    name = name.strip("-") or "unknown-gpu"
    stem = f"{datetime.date.today().isoformat()}-{name}" + (f"-{title}" if title else "")
    note = " (GPU_CHECK_DRY_RUN=1: CPU, toy and tiny shapes; not GPU figures)" if dry_run else ""
    lines = [
        f"# {'GPU check' if command == 'gpu-check' else 'GPU bench'} {stem}",
        "",
        f"`make {command}{make_args}`{note}, {seconds / 60:.1f} min. Written by trapo/commands/gpu_check.",
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
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    if check.figures:
        about = {"gpu": gpu.split(":", 1)[-1].split(",")[0].strip(), "date": stem[:10], "dry_run": dry_run}
        path.with_suffix(".json").write_text(json.dumps({**about, **check.figures}, indent=1) + "\n")
    return path


def shown(path: Path) -> str:
    """`path` as the user would type it from here: relative to the working directory where it is under it."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)
