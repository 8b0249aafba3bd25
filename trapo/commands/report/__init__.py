"""Plots and a short Markdown report for one training run.

    python -m trapo report RUN_DIR [--out DIR]      # make report RUN=outputs/toy

Reads RUN_DIR/metrics.jsonl (one object per training step, written by
`Trainer.train`) and, when present, RUN_DIR/selection.jsonl (one row per epoch
end after warm-up, written by `Trainer._end_epoch`), summary.json and
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
import sys
from pathlib import Path

from trapo.commands.report.markdown import write_report
from trapo.commands.report.plots import (
    DPI,
    LABELED,
    MAX_PANELS,
    PHASE_COLORS,
    PLOTS,
    REJECTED,
    RIGHT,
    SELECTED,
    TRAJECTORY_SAMPLE,
    UNLABELED,
    WRONG,
    Plot,
    Skip,
    plot_rewards,
    plot_selection,
    plot_tcs,
    plot_timing,
    plot_trajectories,
    timing_table,
)
from trapo.commands.report.run import (
    ReportError,
    Run,
    Trajectories,
    epoch_selection,
    is_number,
    last_per_epoch,
    load_run,
    lookup,
    moving_average,
    read_jsonl,
    selection_summary,
    series,
    smoothing_window,
    spread_sample,
    steps_per_epoch,
    trajectories_from_selection,
)
from trapo.training.rollout_dump import latest_dump

__all__ = [
    "DPI",
    "LABELED",
    "MAX_PANELS",
    "PHASE_COLORS",
    "PLOTS",
    "REJECTED",
    "RIGHT",
    "SELECTED",
    "TRAJECTORY_SAMPLE",
    "UNLABELED",
    "WRONG",
    "Plot",
    "ReportError",
    "Run",
    "Skip",
    "Trajectories",
    "epoch_selection",
    "is_number",
    "last_per_epoch",
    "load_run",
    "lookup",
    "main",
    "moving_average",
    "plot_rewards",
    "plot_selection",
    "plot_tcs",
    "plot_timing",
    "plot_trajectories",
    "read_jsonl",
    "selection_summary",
    "series",
    "smoothing_window",
    "spread_sample",
    "steps_per_epoch",
    "timing_table",
    "trajectories_from_selection",
    "write_report",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trapo report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl (output_dir/run_name)")
    parser.add_argument("--out", default=None, help="where to write the PNGs and report.md (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.run_dir, args.out)
    except ReportError as err:
        print(f"trapo report: {err}", file=sys.stderr)
        return 2
    skipped = report.read_text().count("_Skipped:")
    print(f"wrote {report} ({len(PLOTS) - skipped} plots, {skipped} skipped)")
    dump = latest_dump(Path(args.run_dir))
    if dump is not None:
        print(f"latest rollout dump: {dump}")
    return 0
