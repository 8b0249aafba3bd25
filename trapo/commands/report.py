"""Plots and a short Markdown report for one training run.

    python -m trapo report RUN_DIR [--out DIR]      # make report RUN=outputs/toy

Reads RUN_DIR/metrics.jsonl (one object per training step, written by
`Trainer.train`) and, when present, RUN_DIR/selection.jsonl (one row per epoch
end after warm-up, written by `Trainer._dump_selection`), summary.json and
config.yaml, and writes five PNGs and report.md into RUN_DIR/report/:

1. rewards.png      rewards and pass rates (labeled, unlabeled) over steps
2. selection.png    selection size and pseudo-label precision of selected vs rejected, per epoch
3. tcs.png          TCS distribution of right vs wrong pseudo-labels, small multiples over epochs
4. trajectories.png pass-rate trajectories: the reliable database's mean vs selected and rejected questions
5. timing.png       step time per phase, stacked

Any field may be missing (a supervised run has no unlabeled data and no
selection.jsonl; an old run has no trajectory fields): that plot is skipped and
report.md says why. When the run dumped rollouts (logging.rollouts_every), report.md
links the latest RUN_DIR/rollouts/step-K.jsonl. A missing run directory or an empty metrics.jsonl is an
error (`ReportError`, exit status 2).

selection.jsonl rows. Always: `epoch`, and per unlabeled question (aligned
lists) `question` (its index), `tcs`, `pseudo_correct` (majority vote == hidden
gold: true / false / null when unknown) and `selected` (the gate for the next
epoch). Optional, for plot 4 (see `PassRateTracker.selection_row`):

- `pass_rate` [U]: each question's pass rate P_q^(t) in this epoch, the
  column `PassRateTracker.end_epoch` appended to its trajectory;
- `reference` [t]: the reliable database's mean trajectory through this epoch
  (`PassRateTracker.mean_reference()`, after this epoch's selection grew the
  database);
- `pass_rate_history` [U][t]: whole trajectories through this epoch; only on
  the first row a run writes, so that the warm-up epochs (which have no row)
  are known too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from trapo.training.rollout_dump import latest_dump

# Phase colours stay the same in every report so that runs can be compared by eye.
PHASE_COLORS = {
    "rollout": "tab:blue",
    "grading": "tab:orange",
    "update": "tab:green",
    "weight_push": "tab:purple",
    "other": "tab:gray",
    "save": "tab:brown",
}
RIGHT, WRONG = "tab:green", "tab:red"  # right / wrong pseudo-labels
SELECTED, REJECTED = "tab:green", "tab:red"
LABELED, UNLABELED = "tab:blue", "tab:orange"
DPI = 110
MAX_PANELS = 6  # small multiples of the TCS plot
TRAJECTORY_SAMPLE = 6  # questions drawn per group in the trajectory plot


class ReportError(Exception):
    """The run directory cannot be reported on (missing, or no step was logged)."""


class Skip(Exception):
    """A plot's data is absent; the message says why, for report.md."""


# ---------------------------------------------------------------------------- reading


@dataclass
class Run:
    """Everything read from one run directory."""

    path: Path
    metrics: list[dict]
    selection: list[dict] = field(default_factory=list)  # one row per epoch, last written wins
    summary: dict | None = None
    config: dict | None = None
    notes: list[str] = field(default_factory=list)  # problems met while reading, for report.md


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Rows of a JSON-lines file and the number of unreadable lines skipped.

    A run killed mid-write leaves a torn last line; the rest is still worth a report.
    """
    rows, bad = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def last_per_epoch(rows: Iterable[dict]) -> list[dict]:
    """Keep the last row for each epoch, in epoch order.

    A resumed run redoes the epochs after its checkpoint and appends their rows
    again; the later row is the one the run went on with.
    """
    by_epoch = {}
    for row in rows:
        if isinstance(row.get("epoch"), int):
            by_epoch[row["epoch"]] = row
    return [by_epoch[e] for e in sorted(by_epoch)]


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory; raises ReportError naming the path when there is nothing to report."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"run directory not found: {path}" + (" (it is a file)" if path.exists() else ""))
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"no metrics.jsonl in {path} (expected {metrics_path}); is this a run directory?")
    try:
        metrics, bad = read_jsonl(metrics_path)
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"cannot read {metrics_path}: {err}") from err
    if not metrics:
        raise ReportError(f"{metrics_path} has no readable step (empty file, or the run logged no step yet)")
    run = Run(path, metrics)
    if bad:
        run.notes.append(f"metrics.jsonl: {bad} unreadable line(s) skipped (a torn last line from an interrupted run?)")
    # A resumed run moves redone steps aside, but should a step appear twice, the later row is the one kept.
    if all(isinstance(row.get("step"), int) for row in metrics):
        by_step = {row["step"]: row for row in metrics}
        run.metrics = [by_step[s] for s in sorted(by_step)]
    sel_path = path / "selection.jsonl"
    if sel_path.is_file():
        try:
            rows, bad = read_jsonl(sel_path)
        except (OSError, UnicodeDecodeError) as err:  # the per-step plots are still worth writing
            rows, bad = [], 0
            run.notes.append(f"selection.jsonl: unreadable ({err})")
        run.selection = last_per_epoch(rows)
        if bad:
            run.notes.append(f"selection.jsonl: {bad} unreadable line(s) skipped")
    run.summary = _read_json(path / "summary.json", run.notes)
    run.config = _read_yaml(path / "config.yaml", run.notes)
    return run


def _read_json(path: Path, notes: list[str]) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError covers JSON and Unicode decoding errors
        notes.append(f"{path.name}: unreadable ({err})")
        return None
    return data if isinstance(data, dict) else None


def _read_yaml(path: Path, notes: list[str]) -> dict | None:
    if not path.is_file():
        return None
    import yaml  # a project dependency; imported here so that reading metrics alone never needs it

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as err:
        notes.append(f"{path.name}: unreadable ({err})")
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------- series


def lookup(row: dict, key: str):
    """row["timing"]["rollout"] for key "timing.rollout"; None when any part is missing."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def is_number(value) -> bool:
    """A finite int or float; bools are flags, not numbers to plot."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: list[dict], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) over the rows where `key` is a finite number; x is the row's `x_key` or its position."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        y = lookup(row, key)
        if is_number(y):
            x = row.get(x_key)
            xs.append(x if is_number(x) else i + 1)
            ys.append(float(y))
    return xs, ys


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values; per-step values from one batch are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    """About 1/20 of the run, at least 1: enough to see the trend, short enough to keep its shape."""
    return max(1, n // 20)


def epoch_selection(run: Run) -> list[dict]:
    """Per-epoch selection diagnostics (PassRateTracker.end_epoch's dict), in epoch order.

    metrics.jsonl has them at every epoch end, warm-up included; without them
    (an older or trimmed metrics file) they are recomputed from selection.jsonl.
    """
    rows = last_per_epoch(r["selection"] for r in run.metrics if isinstance(r.get("selection"), dict))
    if rows:
        return rows
    return [selection_summary(row) for row in run.selection]


def selection_summary(row: dict) -> dict:
    """The end_epoch diagnostics that a selection.jsonl row determines."""
    tcs, correct, selected = row.get("tcs") or [], row.get("pseudo_correct") or [], row.get("selected") or []
    chosen = [c for c, s in zip(correct, selected) if s and c is not None]
    rejected = [c for c, s in zip(correct, selected) if not s and c is not None]
    return {
        "epoch": row.get("epoch"),
        "selected": sum(bool(s) for s in selected),
        "unlabeled": len(selected),
        "tcs_selected": _mean([t for t, s in zip(tcs, selected) if s]),
        "tcs_rejected": _mean([t for t, s in zip(tcs, selected) if not s]),
        "precision_selected": _mean([float(c) for c in chosen]),
        "precision_rejected": _mean([float(c) for c in rejected]),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def steps_per_epoch(run: Run) -> int | None:
    """Steps in one epoch: the most steps logged with the same epoch number (the last epoch may be unfinished)."""
    counts = Counter(row["epoch"] for row in run.metrics if is_number(row.get("epoch")))
    return max(counts.values()) if counts else None


# ---------------------------------------------------------------------------- trajectories


@dataclass
class Trajectories:
    """Per-question pass rates by epoch and the database's mean trajectory, rebuilt from selection.jsonl."""

    rates: dict[int, dict[int, float]]  # question -> epoch -> pass rate
    reference: list[float]  # epoch 1..t
    epoch: int  # the latest row's epoch
    selected: dict[int, bool]  # question -> selected at the latest row
    tcs: dict[int, float]  # question -> TCS at the latest row


def trajectories_from_selection(rows: list[dict]) -> Trajectories | None:
    """Rebuild trajectories from the optional `pass_rate`(+history) and `reference` fields; None when absent."""
    rows = [r for r in rows if isinstance(r.get("pass_rate"), list) and isinstance(r.get("reference"), list)]
    if not rows:
        return None
    rates: dict[int, dict[int, float]] = {}
    for row in rows:
        epoch = row["epoch"]
        history = row.get("pass_rate_history")
        for i, q in enumerate(row.get("question") or []):
            per_q = rates.setdefault(q, {})
            if isinstance(history, list) and i < len(history):
                for e, rate in enumerate(history[i], start=1):
                    per_q.setdefault(e, rate)  # a later row's own pass_rate wins for its epoch
            if i < len(row["pass_rate"]) and is_number(row["pass_rate"][i]):
                per_q[epoch] = row["pass_rate"][i]
    last = rows[-1]
    questions = last.get("question") or []
    return Trajectories(
        rates=rates,
        reference=[float(x) for x in last["reference"]],
        epoch=last["epoch"],
        selected=dict(zip(questions, [bool(s) for s in last.get("selected") or []])),
        tcs=dict(zip(questions, last.get("tcs") or [])),
    )


def spread_sample(items: list, k: int) -> list:
    """k items evenly spaced through a sorted list (first and last included): a deterministic, representative pick."""
    if len(items) <= k:
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)] if k > 1 else [items[0]]


# ---------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    # matplotlib.figure.Figure renders with Agg and touches no global pyplot state or display.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _integer_ticks(ax, axis: str = "x") -> None:
    """Epochs and question counts are whole numbers; the default locator would label 2.5."""
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=DPI)


def plot_rewards(run: Run, path: Path) -> None:
    """1. Rewards and pass rates of labeled and unlabeled questions over steps (raw faint, moving average bold)."""
    curves = {
        "reward": [("reward_labeled", "labeled", LABELED), ("reward_unlabeled", "unlabeled", UNLABELED)],
        "pass rate": [
            ("pass_rate_labeled", "labeled (vs gold)", LABELED),
            ("pass_rate_unlabeled", "unlabeled (vs majority vote)", UNLABELED),
            ("pseudo_label_precision", "pseudo-label precision (majority == hidden gold)", "tab:gray"),
        ],
    }
    data = {panel: [(series(run.metrics, k), label, c) for k, label, c in lines] for panel, lines in curves.items()}
    data = {panel: [d for d in lines if d[0][1]] for panel, lines in data.items()}
    if not any(data.values()):
        raise Skip("metrics.jsonl has no reward or pass-rate values")
    if _rewards_equal_pass_rates(run):
        data.pop("reward")  # majority-vote rewards are the pass rates: one panel says it all
    panels = [p for p in data if data[p]]
    n = len(run.metrics)
    window = smoothing_window(n)
    fig = _figure(6.5 * len(panels), 4.2)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    first_sel = _first_selection_step(run)
    for ax, panel in zip(axes, panels):
        for (xs, ys), label, color in data[panel]:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, moving_average(ys, window), color=color, linewidth=2, label=label)
        if panel == "pass rate":
            _plot_eval(ax, run)
        if first_sel is not None:
            ax.axvline(first_sel, color="black", linestyle=":", linewidth=1, label="first selection (gate opens)")
        ax.set_xlabel("training step")
        ax.set_ylabel(panel)
        if panel == "pass rate":  # rewards other than the majority vote's may leave [0, 1]
            ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        title = panel.capitalize() + (" (= reward: majority-vote rewards)" if "reward" not in panels else "")
        ax.set_title(title, fontsize=11)
    smooth = f"bold: moving average over {window} steps, faint: per step" if window > 1 else "per step"
    fig.suptitle(f"Rewards and pass rates ({smooth})", fontsize=12)
    _save(fig, path)


def _rewards_equal_pass_rates(run: Run) -> bool:
    """True when every logged reward equals the pass rate of the same step (the majority-vote reward)."""
    pairs = [("reward_labeled", "pass_rate_labeled"), ("reward_unlabeled", "pass_rate_unlabeled")]
    for row in run.metrics:
        for r, p in pairs:
            if is_number(row.get(r)) and not (is_number(row.get(p)) and abs(row[r] - row[p]) < 1e-9):
                return False
    return True


def _first_selection_step(run: Run) -> float | None:
    """The step after which the first selection gated unlabeled questions in (end of warm-up)."""
    for row in run.metrics:
        sel = row.get("selection")
        if isinstance(sel, dict) and sel.get("tcs_selected") is not None and is_number(row.get("step")):
            return row["step"]
    return None


def _plot_eval(ax, run: Run) -> None:
    xs, ys = series(run.metrics, "eval.mean")
    if xs:
        ax.plot(xs, ys, "s--", color="black", markersize=5, linewidth=1, label="validation score (eval.mean)")


def plot_selection(run: Run, path: Path) -> None:
    """2. Per epoch: selected unlabeled questions and database size; pseudo-label precision selected vs rejected."""
    rows = epoch_selection(run)
    if not rows:
        why = "selection.jsonl is absent" if not (run.path / "selection.jsonl").exists() else "it has no rows"
        raise Skip(f"no selection diagnostics: metrics.jsonl logged no epoch end and {why}")
    if not any(r.get("unlabeled") for r in rows) and not any(r.get("selected") for r in rows):
        raise Skip("the run has no unlabeled questions (a supervised run), so nothing is selected")
    epochs = [r["epoch"] for r in rows]
    warmup = [r["epoch"] for r in rows if r.get("tcs_selected") is None and r.get("tcs_rejected") is None]
    fig = _figure(12, 4.2)
    left, right = fig.subplots(1, 2)
    left.bar(epochs, [r.get("selected") or 0 for r in rows], color=SELECTED, alpha=0.8, label="selected unlabeled")
    db = [(r["epoch"], r["database"]) for r in rows if is_number(r.get("database"))]
    if db:
        left.plot(*zip(*db), "o-", color="black", markersize=3, label="reliable database (labeled + ever selected)")
    unlabeled = max((r.get("unlabeled") or 0 for r in rows), default=0)
    left.set_title(f"Selection size (of {unlabeled} unlabeled questions)", fontsize=11)
    left.set_ylabel("questions")
    for key, label, color in (
        ("precision_selected", "selected", SELECTED),
        ("precision_rejected", "rejected", REJECTED),
    ):
        xs, ys = series(rows, key, x_key="epoch")
        if xs:
            right.plot(xs, ys, "o-", color=color, markersize=4, label=label)
    right.set_ylim(-0.02, 1.02)
    right.set_ylabel("share of pseudo-labels equal to the hidden gold")
    right.set_title("Pseudo-label precision", fontsize=11)
    for ax in (left, right):
        if warmup:
            ax.axvspan(
                min(warmup) - 0.5, max(warmup) + 0.5, color="gray", alpha=0.15, label="warm-up: no selection made"
            )
        ax.set_xlabel("epoch (selection made at its end)")
        _integer_ticks(ax)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="best", fontsize=8)
    fig.suptitle("Selection of unlabeled questions per epoch", fontsize=12)
    _save(fig, path)


def plot_tcs(run: Run, path: Path) -> None:
    """3. TCS histograms of right vs wrong pseudo-labels, one panel per epoch (up to MAX_PANELS, latest included)."""
    if not run.selection:
        raise Skip("selection.jsonl is absent or empty (a supervised run, or no selection after warm-up yet)")
    rows = [r for r in run.selection if any(c is not None for c in r.get("pseudo_correct") or [])]
    if not rows:
        raise Skip("no hidden gold answers: `pseudo_correct` is null for every question, so right vs wrong is unknown")
    rows = spread_sample(rows, MAX_PANELS)
    all_tcs = [t for r in rows for t in r.get("tcs") or [] if is_number(t)]
    if not all_tcs:
        raise Skip("selection.jsonl rows carry no `tcs` values")
    lo, hi = min(all_tcs), max(all_tcs)
    if hi - lo < 1e-6:  # one value everywhere: give the single bar some width
        lo, hi = lo - 0.05, hi + 0.05
    bins = [lo + (hi - lo + 1e-9) * i / 20 for i in range(21)]  # shared bins: panels compare by eye
    cols = len(rows) if len(rows) <= 3 else math.ceil(math.sqrt(len(rows)))  # 4 -> 2 x 2, 5 or 6 -> 3 + 2 or 3
    nrows = -(-len(rows) // cols)
    fig = _figure(4.2 * cols, 3.2 * nrows + 0.6)
    axes = fig.subplots(nrows, cols, squeeze=False, sharex=True, sharey=True)
    for i, (ax, row) in enumerate(zip(axes.flat, rows)):
        _tcs_panel(ax, row, bins)
        if i % cols == 0:
            ax.set_ylabel("unlabeled questions")
        if i + cols >= len(rows):  # the lowest panel of its column carries the axis label
            ax.set_xlabel("TCS (similarity to the reliable database)")
            ax.xaxis.set_tick_params(labelbottom=True)
    for ax in list(axes.flat)[len(rows) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=9)
    fig.suptitle("TCS of right vs wrong pseudo-labels", fontsize=12)
    _save(fig, path)


def _tcs_panel(ax, row: dict, bins: list[float]) -> None:
    tcs, correct, selected = row.get("tcs") or [], row.get("pseudo_correct") or [], row.get("selected") or []
    right = [t for t, c in zip(tcs, correct) if c is True and is_number(t)]
    wrong = [t for t, c in zip(tcs, correct) if c is False and is_number(t)]
    # Side by side, not overlaid: overlapping translucent bars mix into a third colour.
    ax.hist([right, wrong], bins=bins, color=[RIGHT, WRONG], label=["right pseudo-label", "wrong pseudo-label"])
    chosen = [t for t, s in zip(tcs, selected) if s and is_number(t)]
    if chosen:
        ax.axvline(min(chosen), color="black", linestyle="--", linewidth=1, label="lowest selected TCS (cut)")
    ax.set_title(f"epoch {row.get('epoch')}: {len(chosen)} selected", fontsize=10)
    _integer_ticks(ax, "y")
    ax.grid(alpha=0.3)


def plot_trajectories(run: Run, path: Path) -> None:
    """4. The database's mean trajectory vs a spread of selected (left) and rejected (right) questions' trajectories."""
    if not run.selection:
        raise Skip("selection.jsonl is absent or empty (a supervised run, or no selection after warm-up yet)")
    traj = trajectories_from_selection(run.selection)
    if traj is None:
        raise Skip(
            "selection.jsonl rows carry no `pass_rate` / `reference` fields (the trainer that wrote them predates "
            "them; see `trapo.algorithm.passrate.PassRateTracker.selection_row`)"
        )
    fig = _figure(12, 5.2)
    axes = fig.subplots(1, 2, sharey=True)
    ref_epochs = list(range(1, len(traj.reference) + 1))
    for ax, want, color, name in ((axes[0], True, SELECTED, "selected"), (axes[1], False, REJECTED, "rejected")):
        group = sorted((traj.tcs.get(q, 0.0), q) for q, s in traj.selected.items() if s == want)
        shown = spread_sample([q for _, q in group], TRAJECTORY_SAMPLE)
        for i, q in enumerate(shown):
            epochs = sorted(traj.rates.get(q, {}))
            ax.plot(
                epochs,
                [traj.rates[q][e] for e in epochs],
                color=color,
                alpha=0.45,
                linewidth=1,
                marker=".",
                label=f"{name} questions ({len(shown)} of {len(group)}, spread over TCS)" if i == 0 else None,
            )
        mean = _group_mean(traj, [q for _, q in group])
        if mean:
            ax.plot(*zip(*mean), color=color, linewidth=2.5, label=f"mean of all {len(group)} {name}")
        ax.plot(ref_epochs, traj.reference, color="black", linewidth=2.5, label="reliable database mean (reference)")
        ax.set_title(f"{name.capitalize()} at epoch {traj.epoch}", fontsize=11)
        ax.set_xlabel("epoch")
        _integer_ticks(ax)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        # Below the axes: inside, the box hides the lines that matter most (trajectories span the whole height).
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=1, frameon=False)
    axes[0].set_ylabel("pass rate")
    fig.suptitle("Pass-rate trajectories vs the reliable database's mean", fontsize=12)
    _save(fig, path)


def _group_mean(traj: Trajectories, questions: list[int]) -> list[tuple[int, float]]:
    """(epoch, mean pass rate) over the questions that have a rate at that epoch."""
    by_epoch: dict[int, list[float]] = {}
    for q in questions:
        for e, rate in traj.rates.get(q, {}).items():
            by_epoch.setdefault(e, []).append(rate)
    return [(e, sum(v) / len(v)) for e, v in sorted(by_epoch.items())]


def plot_timing(run: Run, path: Path) -> None:
    """5. Seconds per step stacked by phase (left) and each phase's share of the total (right)."""
    phases, table = timing_table(run.metrics)
    if not phases:
        raise Skip("metrics.jsonl has no `timing` values")
    steps = [s for s, _ in table]
    fig = _figure(12, 4.2)
    left, right = fig.subplots(1, 2, width_ratios=[2.2, 1])
    bottom = [0.0] * len(table)
    for name in phases:
        top = [b + row.get(name, 0.0) for b, (_, row) in zip(bottom, table)]
        color = PHASE_COLORS.get(name)
        left.fill_between(steps, bottom, top, step="mid", color=color, alpha=0.85, linewidth=0, label=name)
        bottom = top
    left.set_xlabel("training step")
    left.set_ylabel("seconds")
    left.set_title("Time per step, stacked by phase", fontsize=11)
    left.grid(alpha=0.3)
    left.legend(loc="upper right", fontsize=8, ncol=2)
    totals = [sum(row.get(name, 0.0) for _, row in table) for name in phases]
    grand = sum(totals) or 1.0
    colors = [PHASE_COLORS.get(name, "tab:cyan") for name in phases]
    right.barh(phases, totals, color=colors)
    right.invert_yaxis()  # same top-to-bottom order as the stack's legend
    for i, total in enumerate(totals):
        right.text(total, i, f" {total:.0f} s ({100 * total / grand:.0f}%)", va="center", fontsize=8)
    right.set_xlim(0, max(totals) * 1.45 or 1)  # room for the labels
    right.set_xlabel("seconds over the whole run")
    right.set_title(f"Total {grand:.0f} s over {len(table)} steps", fontsize=11)
    fig.suptitle("Step time breakdown (`other`: untimed work inside the step; `save`: checkpoints)", fontsize=12)
    _save(fig, path)


def timing_table(metrics: list[dict]) -> tuple[list[str], list[tuple[float, dict[str, float]]]]:
    """Phases in stacking order and, per step, seconds per phase.

    `timing.step` spans the whole train_step; the phases inside it are split
    out and the remainder is `other`. `save` is timed after the step, so it
    stacks on top instead of being part of `step`.
    """
    known = [p for p in PHASE_COLORS if p not in ("other", "save")]
    extra = sorted({k for r in metrics for k in (r.get("timing") or {}) if k not in PHASE_COLORS and k != "step"})
    inner = known + extra
    table = []
    for i, row in enumerate(metrics):
        timing = row.get("timing")
        if not isinstance(timing, dict):
            continue
        parts = {k: float(v) for k, v in timing.items() if k in inner and is_number(v)}
        if is_number(timing.get("step")):
            parts["other"] = max(0.0, float(timing["step"]) - sum(parts.values()))
        if is_number(timing.get("save")):
            parts["save"] = float(timing["save"])
        step = row.get("step")
        table.append((step if is_number(step) else i + 1, parts))
    order = inner + ["other", "save"]
    phases = [p for p in order if any(p in parts for _, parts in table)]
    return phases, table


@dataclass
class Plot:
    """One figure of the report: its file, heading, function and how to read it."""

    file: str
    heading: str
    make: Callable[[Run, Path], None]
    guidance: str


PLOTS = [
    Plot(
        "rewards.png",
        "Rewards and pass rates",
        plot_rewards,
        "Labeled pass rate (vs gold) is the honest learning signal; the unlabeled pass rate is agreement with the "
        "majority vote, so it can rise while the pseudo-labels stay wrong: compare it with the gray pseudo-label "
        "precision.",
    ),
    Plot(
        "selection.png",
        "Selection per epoch",
        plot_selection,
        "A working gate keeps the green precision (selected) above the red (rejected); in warm-up epochs (gray) only "
        "the rejected line exists and is the precision of all unlabeled questions.",
    ),
    Plot(
        "tcs.png",
        "TCS of right vs wrong pseudo-labels",
        plot_tcs,
        "The more the green histogram lies right of the red one, the better TCS separates right from wrong "
        "pseudo-labels; questions right of the dashed cut are trained on in the next epoch.",
    ),
    Plot(
        "trajectories.png",
        "Pass-rate trajectories",
        plot_trajectories,
        "Selected questions should follow the shape of the black reference (the labeled + selected database's mean) "
        "and rejected ones stray from it; with `selection.standardize: true` TCS compares shapes, not levels.",
    ),
    Plot(
        "timing.png",
        "Step time",
        plot_timing,
        "The tallest band is where a step's time goes: rollout and update should dominate; a large `grading`, "
        "`weight_push` or `other` band points at overhead.",
    ),
]


# ---------------------------------------------------------------------------- report


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl (output_dir/run_name)")
    parser.add_argument("--out", default=None, help="where to write the PNGs and report.md (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.run_dir, args.out)
    except ReportError as err:
        print(f"trapo.commands.report: {err}", file=sys.stderr)
        return 2
    skipped = report.read_text().count("_Skipped:")
    print(f"wrote {report} ({len(PLOTS) - skipped} plots, {skipped} skipped)")
    dump = latest_dump(Path(args.run_dir))
    if dump is not None:
        print(f"latest rollout dump: {dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
