"""The report's five matplotlib figures (rewards, selection, TCS, trajectories, timing), their colours,
and `PLOTS`: each figure's file, heading, drawing function and how to read it in report.md.

A plot whose data is absent raises `Skip`, whose message report.md shows instead of the picture.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trapo.commands.report.run import (
    Run,
    Trajectories,
    epoch_selection,
    is_number,
    moving_average,
    series,
    smoothing_window,
    spread_sample,
    trajectories_from_selection,
)

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


class Skip(Exception):
    """A plot's data is absent; the message says why, for report.md."""


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
