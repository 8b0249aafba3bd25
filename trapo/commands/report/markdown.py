"""report.md: `write_report` draws every plot of `PLOTS` into the output directory and writes the
Markdown around them (a header of facts about the run, one section per plot or why it was skipped)."""

from __future__ import annotations

import os
from pathlib import Path

from trapo.commands.report.plots import PLOTS, Skip
from trapo.commands.report.run import Run, epoch_selection, is_number, load_run, lookup, steps_per_epoch
from trapo.training.rollout_dump import latest_dump


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and report.md for a run; returns the report.md path. Raises ReportError."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for i, plot in enumerate(PLOTS, start=1):
        target = out / plot.file
        target.unlink(missing_ok=True)  # a stale picture from an earlier report must not survive a skip
        try:
            plot.make(run, target)
        except Skip as why:
            sections.append(f"## {i}. {plot.heading}\n\n_Skipped: {why}._\n")
        else:
            sections.append(f"## {i}. {plot.heading}\n\n![{plot.heading}]({plot.file})\n\n{plot.guidance}\n")
    text = "\n".join([_header(run, out), *sections])
    report = out / "report.md"
    report.write_text(text)
    return report


def _header(run: Run, out: Path) -> str:
    """Title and a few facts: steps, mode, held-out accuracy, the last selection, the latest rollout dump."""
    lines = [f"# Training report: {run.path.name}", "", f"Run directory: `{run.path}`", ""]
    facts = [f"{len(run.metrics)} steps logged"]
    epochs = [r["epoch"] for r in run.metrics if is_number(r.get("epoch"))]
    if epochs:
        facts.append(f"{max(epochs)} epochs")
    per_epoch = steps_per_epoch(run)
    if per_epoch:  # dynamic sampling's refills consume batches: epochs then differ in length
        refills = any("dynamic_sampling" in r for r in run.metrics)
        facts.append(f"{'up to ' if refills else ''}{per_epoch} steps per epoch")
    mode = lookup(run.config or {}, "mode")
    if mode:
        facts.append(f"mode `{mode}`")
    skipped = sum(1 for r in run.metrics if r.get("skipped") is True)
    if skipped:
        facts.append(f"{skipped} step(s) skipped for a non-finite loss")
    lines += ["- " + ", ".join(facts)]
    summary = run.summary or {}
    before, after = summary.get("heldout_accuracy_before"), summary.get("heldout_accuracy_after")
    if is_number(before) or is_number(after):
        lines.append(f"- held-out accuracy: {_fmt(before)} before, {_fmt(after)} after training")
    avg = summary.get("heldout_avg")  # eval.heldout_k > 0: avg@k at eval.temperature beside the greedy figure
    if isinstance(avg, dict) and is_number(summary.get("heldout_avg_after")):
        lines.append(
            f"- held-out avg@{avg.get('k')} at temperature {avg.get('temperature')}: "
            f"{_fmt(summary.get('heldout_avg_before'))} before, {_fmt(summary['heldout_avg_after'])} after training"
        )
    rows = epoch_selection(run)
    last = rows[-1] if rows else None
    if last and last.get("unlabeled"):
        lines.append(
            f"- last selection (epoch {last.get('epoch')}): {last.get('selected')} of {last.get('unlabeled')} "
            f"unlabeled questions, database {last.get('database', '-')}, pseudo-label precision "
            f"{_fmt(last.get('precision_selected'))} selected vs {_fmt(last.get('precision_rejected'))} rejected"
        )
    dump = latest_dump(run.path)
    if dump is not None:  # logging.rollouts_every: the prompts, responses and rewards behind the curves
        link = os.path.relpath(dump, out)
        lines.append(f"- latest rollout dump: [{dump.parent.name}/{dump.name}]({link}) (prompts, responses, rewards)")
    lines += [f"- note: {n}" for n in run.notes]
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return f"{x:.3f}" if is_number(x) else "-"
