"""TensorBoard event files for a run (config `logging.tensorboard: true`).

    writer = TensorBoardWriter(run_dir / "tensorboard")   # main rank only
    writer.log_step(values)          # the dict written to metrics.jsonl, once per step
    writer.log_selection(row)        # a selection.jsonl row, once per epoch end
    writer.close()

`log_step` writes every numeric value of the step dict as a scalar at global
step `values["step"]`, nested dicts flattened with "/" (`timing/rollout`,
`selection/precision_selected`, `eval/mean`). `log_selection` writes per-epoch
selection diagnostics at global step = epoch under `selection_epoch/`, and TCS
histograms (all unlabeled questions, right and wrong pseudo-labels).

The event files are written with tensorboardX (numpy + protobuf, no
TensorFlow and no `tensorboard` server package). It is imported only when a
writer is made, so runs without `logging.tensorboard` never need it; when it
is missing, `TensorBoardUnavailable` (a ConfigError) names the config key.
`read_scalars` reads the files back without tensorboard, for tests and scripts.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

from trapo.config import ConfigError

CONFIG_KEY = "logging.tensorboard"
PACKAGE = "tensorboardX==2.6.5"  # the pin in requirements.txt


class TensorBoardUnavailable(ConfigError):
    """`logging.tensorboard: true` but tensorboardX is not installed."""


def _summary_writer_class():
    """tensorboardX.SummaryWriter, imported on first use (the package is optional)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as err:
        raise TensorBoardUnavailable(
            f"{CONFIG_KEY}: true needs the tensorboardX package, which is not installed ({err}); "
            f"install it with `pip install {PACKAGE}` or set {CONFIG_KEY}=false"
        ) from err
    return SummaryWriter


def scalar_value(value) -> float | None:
    """A loggable float, or None for what is not a scalar.

    bool -> 0.0 / 1.0 (flags such as `skipped` are worth a curve); int, float,
    numpy and 0-d torch numbers -> float; None, strings, lists -> None.
    NaN and inf -> None: TensorBoard draws them as gaps or breaks the axis
    range, and a non-finite loss is already recorded by the `skipped` flag.
    """
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalar or 0-d tensor
        value = value.item()
        if isinstance(value, bool):
            return float(value)
    if not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def flatten_scalars(values: Mapping, prefix: str = "") -> dict[str, float]:
    """{"timing": {"rollout": 0.5}, "loss": 1.0} -> {"timing/rollout": 0.5, "loss": 1.0}; non-scalars dropped."""
    out = {}
    for key, value in values.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_scalars(value, prefix=f"{tag}/"))
            continue
        scalar = scalar_value(value)
        if scalar is not None:
            out[tag] = scalar
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def selection_scalars(row: Mapping) -> dict[str, float]:
    """Per-epoch diagnostics of a selection.jsonl row: size, share, precision, mean TCS and mean strategy score
    (`score_*`, rows that carry one) of selected vs rejected.

    Precision counts only questions with a known pseudo-label correctness (a
    hidden gold); a value with no question to average over is left out.
    """
    tcs = list(row.get("tcs") or [])
    correct = list(row.get("pseudo_correct") or [])
    selected = [bool(s) for s in row.get("selected") or []]
    chosen = [i for i, s in enumerate(selected) if s]
    rejected = [i for i, s in enumerate(selected) if not s]
    known = [c is not None for c in correct] + [False] * (len(selected) - len(correct))
    values = {
        "size": len(chosen),
        "unlabeled": len(selected),
        "share": len(chosen) / len(selected) if selected else None,
        "precision_selected": _mean([float(correct[i]) for i in chosen if known[i]]),
        "precision_rejected": _mean([float(correct[i]) for i in rejected if known[i]]),
        "tcs_selected": _mean([tcs[i] for i in chosen if i < len(tcs)]),
        "tcs_rejected": _mean([tcs[i] for i in rejected if i < len(tcs)]),
        "tcs_cut": min((tcs[i] for i in chosen if i < len(tcs)), default=None),
    }
    score = list(row.get("score") or [])  # the strategy's ranking score (trapo.algorithm.selection); None: unscored
    if any(scalar_value(x) is not None for x in score):
        values["score_selected"] = _mean([score[i] for i in chosen if i < len(score) and score[i] is not None])
        values["score_rejected"] = _mean([score[i] for i in rejected if i < len(score) and score[i] is not None])
    reference = row.get("reference")  # optional field, see trapo.commands.report
    if isinstance(reference, list) and reference:
        values["reference_pass_rate"] = reference[-1]
    return flatten_scalars({k: v for k, v in values.items() if v is not None})


def tcs_groups(row: Mapping) -> dict[str, list[float]]:
    """TCS values for histograms: all unlabeled questions, and those with right / wrong pseudo-labels."""
    tcs = [t for t in row.get("tcs") or [] if scalar_value(t) is not None]
    pairs = [
        (t, c) for t, c in zip(row.get("tcs") or [], row.get("pseudo_correct") or []) if scalar_value(t) is not None
    ]
    return {
        "tcs": tcs,
        "tcs_right_pseudo_label": [t for t, c in pairs if c is True],
        "tcs_wrong_pseudo_label": [t for t, c in pairs if c is False],
    }


class TensorBoardWriter:
    """Writes the trainer's per-step metrics and per-epoch selection rows as TensorBoard events.

    Make one on the main rank only: every rank writing would duplicate the
    curves. `flush_secs` bounds how stale a live TensorBoard view gets.
    """

    def __init__(self, log_dir: str | Path, *, flush_secs: int = 30):
        writer_class = _summary_writer_class()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = writer_class(logdir=str(self.log_dir), flush_secs=flush_secs)

    def log_step(self, values: Mapping, step: int | None = None) -> int:
        """Every numeric value of one metrics.jsonl row as a scalar; returns how many were written.

        step defaults to values["step"] (the x axis, so not itself written).
        """
        step = int(values["step"]) if step is None else int(step)
        scalars = flatten_scalars({k: v for k, v in values.items() if k != "step"})
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        return len(scalars)

    def log_selection(self, row: Mapping, step: int | None = None) -> None:
        """One selection.jsonl row: scalars and TCS histograms under `selection_epoch/`, at step = its epoch."""
        import numpy as np  # a dependency of tensorboardX and of the project; only needed here

        step = int(row["epoch"]) if step is None else int(step)
        for tag, value in selection_scalars(row).items():
            self._writer.add_scalar(f"selection_epoch/{tag}", value, step)
        for tag, values in tcs_groups(row).items():
            if values:  # an empty histogram is an error in tensorboardX
                self._writer.add_histogram(f"selection_epoch/{tag}", np.asarray(values, dtype=np.float64), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- reading back


def read_events(log_dir: str | Path) -> Iterator:
    """Every Event record of the event files under log_dir, in file order (tensorboardX's Event proto).

    The files are TFRecord framed: uint64 length, uint32 masked CRC of the
    length, the serialized Event, uint32 masked CRC of it. The CRCs are not
    checked here; a truncated last record (a writer killed mid-write) ends
    that file.
    """
    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            start, end = pos + 12, pos + 12 + length
            if end + 4 > len(data):
                break
            event = Event()
            event.ParseFromString(data[start:end])
            yield event
            pos = end + 4


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar under log_dir, in the order written."""
    out: dict[str, list[tuple[int, float]]] = {}
    for event in read_events(log_dir):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def read_histogram_tags(log_dir: str | Path) -> dict[str, list[int]]:
    """{tag: [step, ...]} of every histogram under log_dir."""
    out: dict[str, list[int]] = {}
    for event in read_events(log_dir):
        for value in event.summary.value:
            if value.HasField("histo"):
                out.setdefault(value.tag, []).append(event.step)
    return out
