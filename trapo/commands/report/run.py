"""Reading one run directory for the report: metrics.jsonl, selection.jsonl, summary.json and config.yaml
into a `Run`, and the series, per-epoch selection summaries and pass-rate trajectories the plots and
report.md are drawn from (no matplotlib here)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


class ReportError(Exception):
    """The run directory cannot be reported on (missing, or no step was logged)."""


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
