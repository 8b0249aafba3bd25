"""trapo.commands.report (plots + report.md of a run directory) and trapo.training.tensorboard_writer,
on synthetic run files."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from trapo.algorithm.passrate import PassRateTracker, SelectionConfig
from trapo.commands import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = [p.file for p in report.PLOTS]
U = 12  # unlabeled questions in the synthetic runs, indices 4..15 (0..3 labeled)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def metrics_rows(steps=12, per_epoch=3, unlabeled=True, warmup=1):
    """Rows shaped like Trainer.train_step's log: rewards, pass rates, timing, selection at epoch ends."""
    rows = []
    for step in range(1, steps + 1):
        epoch = (step - 1) // per_epoch + 1
        row = {
            "step": step,
            "epoch": epoch,
            "loss": 0.1 / step,
            "entropy": 0.3,
            "reward_labeled": 0.3 + 0.02 * step,
            "pass_rate_labeled": 0.3 + 0.02 * step,
            "skipped": False,
            "timing": {"rollout": 0.5, "grading": 0.1, "update": 0.3, "weight_push": 0.05, "step": 1.0},
        }
        if unlabeled:
            row.update(
                reward_unlabeled=0.5 + 0.01 * step,
                pass_rate_unlabeled=0.5 + 0.01 * step,
                pseudo_label_precision=0.45,
                unlabeled_in_loss=0,
                selected_unlabeled=0,
            )
        if step % per_epoch == 0:
            ran = unlabeled and epoch >= warmup
            row["selection"] = {
                "epoch": epoch,
                "unrecorded": 0,
                "selected": 3 if ran else 0,
                "unlabeled": U if unlabeled else 0,
                "database": 4 + (3 * (epoch - warmup + 1) if ran else 0),
                "tcs_selected": 0.8 if ran else None,
                "tcs_rejected": 0.2 if ran else None,
                "precision_selected": 0.9 if ran else None,
                "precision_rejected": 0.4 if unlabeled else None,
            }
        if step == steps:
            row["timing"]["save"] = 0.7
            row["eval"] = {"toy": 0.5, "mean": 0.5}
        rows.append(row)
    return rows


def selection_rows(epochs=4, trajectories=True):
    """selection.jsonl rows (epochs 1..epochs), optionally with pass_rate / reference / pass_rate_history."""
    rows = []
    questions = list(range(4, 4 + U))
    for epoch in range(1, epochs + 1):
        tcs = [round(1 - i / U, 3) for i in range(U)]
        row = {
            "epoch": epoch,
            "question": questions,
            "tcs": tcs,
            "pseudo_correct": [None if i == 5 else i % 3 != 2 for i in range(U)],
            "selected": [t > 0.75 for t in tcs],  # i = 0, 1, 2
        }
        if trajectories:
            row["pass_rate"] = [round((i + epoch) % 8 / 8, 4) for i in range(U)]
            row["reference"] = [0.2 + 0.1 * e for e in range(epoch)]
            if epoch == 1:
                row["pass_rate_history"] = [[r] for r in row["pass_rate"]]
        rows.append(row)
    return rows


def make_run(tmp_path, *, metrics=None, selection=None, name="run"):
    run = tmp_path / name
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", metrics_rows() if metrics is None else metrics)
    if selection is not None:
        write_jsonl(run / "selection.jsonl", selection)
    return run


def skipped_sections(text):
    """{heading: reason} of the plots report.md says were skipped."""
    out = {}
    for section in text.split("\n## ")[1:]:
        heading, _, body = section.partition("\n")
        if "_Skipped:" in body:
            out[heading.split(". ", 1)[1]] = body.split("_Skipped:", 1)[1].strip()
    return out


# ---------------------------------------------------------------------------- the report


def test_full_run_writes_every_plot_and_embeds_it(tmp_path):
    run = make_run(tmp_path, selection=selection_rows())
    avg = {"k": 8, "temperature": 0.6, "before": {"mean": 0.25}, "after": {"mean": 0.75}}
    summary = {"heldout_accuracy_before": 0.4, "heldout_accuracy_after": 0.5, "heldout_avg": avg}
    (run / "summary.json").write_text(json.dumps({**summary, "heldout_avg_before": 0.25, "heldout_avg_after": 0.75}))
    (run / "config.yaml").write_text("mode: trapo\nseed: 0\n")

    assert report.main([str(run)]) == 0

    out = run / "report"
    for name in ALL_PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    text = (out / "report.md").read_text()
    assert "_Skipped" not in text
    for plot in report.PLOTS:
        assert f"]({plot.file})" in text and plot.guidance in text
    assert "mode `trapo`" in text and "0.400 before, 0.500 after" in text
    assert "- held-out avg@8 at temperature 0.6: 0.250 before, 0.750 after training" in text
    assert "last selection (epoch 4): 3 of 12 unlabeled" in text


def test_supervised_run_skips_selection_plots_and_says_why(tmp_path):
    run = make_run(tmp_path, metrics=metrics_rows(unlabeled=False))

    path = report.write_report(run)

    out = path.parent
    assert (out / "rewards.png").is_file() and (out / "timing.png").is_file()
    skipped = skipped_sections(path.read_text())
    assert set(skipped) == {"Selection per epoch", "TCS of right vs wrong pseudo-labels", "Pass-rate trajectories"}
    assert "supervised" in skipped["Selection per epoch"]
    assert "selection.jsonl is absent" in skipped["TCS of right vs wrong pseudo-labels"]
    for name in ("selection.png", "tcs.png", "trajectories.png"):
        assert not (out / name).exists()


def test_rows_without_trajectory_fields_skip_only_that_plot(tmp_path):
    run = make_run(tmp_path, selection=selection_rows(trajectories=False))

    skipped = skipped_sections(report.write_report(run).read_text())

    assert list(skipped) == ["Pass-rate trajectories"]
    assert "`pass_rate` / `reference`" in skipped["Pass-rate trajectories"]


def test_unknown_pseudo_label_correctness_skips_tcs_plot(tmp_path):
    rows = selection_rows()
    for row in rows:
        row["pseudo_correct"] = [None] * U
    run = make_run(tmp_path, selection=rows)

    skipped = skipped_sections(report.write_report(run).read_text())

    assert list(skipped) == ["TCS of right vs wrong pseudo-labels"]
    assert "hidden gold" in skipped["TCS of right vs wrong pseudo-labels"]


def test_sparse_rows_never_crash(tmp_path):
    """Steps with nothing but a step number, nulls and NaN: every plot is skipped, the report is still written."""
    rows = [{"step": 1}, {"step": 2, "reward_labeled": None, "loss": float("nan")}, {"step": 3, "timing": None}]
    run = make_run(tmp_path, metrics=rows, selection=[{"epoch": 1}])

    skipped = skipped_sections(report.write_report(run).read_text())

    assert len(skipped) == len(report.PLOTS)
    assert all(skipped.values())


def test_constant_tcs_and_odd_side_files(tmp_path):
    """One TCS value for every question, a summary.json that is a list, a broken config.yaml: still a report."""
    rows = selection_rows()
    for row in rows:
        row["tcs"] = [0.5] * U
    run = make_run(tmp_path, selection=rows)
    (run / "summary.json").write_text("[1, 2]")
    (run / "config.yaml").write_text("mode: [unclosed\n")

    text = report.write_report(run).read_text()

    assert "_Skipped" not in text
    assert "config.yaml: unreadable" in text


def test_stale_png_is_removed_when_its_plot_is_skipped(tmp_path):
    run = make_run(tmp_path, selection=selection_rows())
    report.write_report(run)
    (run / "selection.jsonl").unlink()
    write_jsonl(run / "metrics.jsonl", metrics_rows(unlabeled=False))

    report.write_report(run)

    assert not (run / "report" / "tcs.png").exists()


def test_torn_last_line_and_resumed_duplicates_are_tolerated(tmp_path):
    rows = metrics_rows()
    run = make_run(tmp_path, metrics=rows + rows[-3:], selection=selection_rows() + selection_rows()[-1:])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "loss"')  # killed mid-write

    text = report.write_report(run).read_text()

    assert "1 unreadable line(s) skipped" in text
    assert "12 steps logged" in text
    assert "_Skipped" not in text


def test_out_dir_option(tmp_path):
    run = make_run(tmp_path)
    assert report.main([str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.md").is_file()
    assert not (run / "report").exists()


def test_report_links_the_latest_rollout_dump(tmp_path, capsys):
    run = make_run(tmp_path)
    assert "rollout dump" not in report.write_report(run).read_text()  # none dumped: no line
    (run / "rollouts").mkdir()
    for step in (9, 10):
        (run / "rollouts" / f"step-{step}.jsonl").write_text("{}\n")
    text = report.write_report(run).read_text()
    assert "- latest rollout dump: [rollouts/step-10.jsonl](../rollouts/step-10.jsonl)" in text
    assert report.main([str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert f"latest rollout dump: {run / 'rollouts' / 'step-10.jsonl'}" in capsys.readouterr().out
    link = "../" + os.path.relpath(run / "rollouts" / "step-10.jsonl", tmp_path)  # relative to the report
    assert f"]({link})" in (tmp_path / "elsewhere" / "report.md").read_text()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "run directory not found"),
        ("no_metrics", "no metrics.jsonl in"),
        ("empty", "has no readable step"),
        ("garbage", "has no readable step"),
        ("binary", "cannot read"),
        ("file", "(it is a file)"),
    ],
)
def test_errors_name_the_path_and_exit_2(tmp_path, capsys, case, expected):
    run = tmp_path / "run"
    if case == "file":
        run.write_text("{}")
    elif case != "missing":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text("")
    if case == "garbage":
        (run / "metrics.jsonl").write_text("not json\n[1, 2]\n")
    if case == "binary":
        (run / "metrics.jsonl").write_bytes(b"\xff\xfe\x00garbage")

    assert report.main([str(run)]) == 2

    err = capsys.readouterr().err
    assert expected in err and str(run) in err
    assert not (tmp_path / "run" / "report").exists()


def test_module_entry_point_exit_status(tmp_path):
    """`python -m trapo report` (what `make report` runs) exits 2 on a missing directory."""
    import subprocess

    missing = tmp_path / "nope"
    proc = subprocess.run(
        [sys.executable, "-m", "trapo", "report", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert str(missing) in proc.stderr


# ---------------------------------------------------------------------------- helpers


def test_trajectory_fields_round_trip_through_a_tracker():
    """The rows the tracker writes (PassRateTracker.selection_row) rebuild its trajectories exactly."""
    labeled = torch.tensor([True, True, False, False, False])
    tracker = PassRateTracker(labeled, SelectionConfig(warmup_epochs=2, top_p=0.34, threshold=2.0))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for epoch in range(1, 6):
        tracker.record(torch.arange(5), (torch.randint(0, 9, (5,), generator=gen) / 8).float())
        tracker.end_epoch()
        if epoch >= 2:  # as the trainer: rows only once selection has run
            rows.append(json.loads(json.dumps(tracker.selection_row(history=not rows))))

    assert "pass_rate_history" in rows[0] and all("pass_rate_history" not in r for r in rows[1:])
    traj = report.trajectories_from_selection(rows)
    for q in [2, 3, 4]:
        rebuilt = [traj.rates[q][e] for e in range(1, 6)]
        assert rebuilt == pytest.approx(tracker.trajectories[q].tolist(), abs=1e-4)
    assert traj.reference == pytest.approx(tracker.mean_reference().tolist(), abs=1e-4)
    assert traj.epoch == 5


def test_small_helpers():
    assert report.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert report.spread_sample(list(range(10)), 3) == [0, 4, 9]  # round(4.5) is 4: banker's rounding
    assert report.spread_sample([1, 2], 5) == [1, 2]
    assert report.lookup({"timing": {"rollout": 2.0}}, "timing.rollout") == 2.0
    assert report.lookup({"timing": None}, "timing.rollout") is None
    assert report.series([{"step": 1, "x": 1}, {"step": 2, "x": True}, {"step": 3, "x": math.nan}], "x") == ([1], [1])
    assert report.last_per_epoch([{"epoch": 2, "v": 1}, {"epoch": 1}, {"epoch": 2, "v": 2}]) == [
        {"epoch": 1},
        {"epoch": 2, "v": 2},
    ]


def test_timing_table_splits_step_into_phases_and_other():
    phases, table = report.timing_table(
        [{"step": 1, "timing": {"rollout": 1.0, "update": 2.0, "compile": 0.5, "step": 4.0, "save": 3.0}}]
    )
    assert phases == ["rollout", "update", "compile", "other", "save"]
    assert table == [(1, {"rollout": 1.0, "update": 2.0, "compile": 0.5, "other": 0.5, "save": 3.0})]


# ---------------------------------------------------------------------------- TensorBoard


def test_tensorboard_writes_flattened_scalars_and_selection(tmp_path):
    from trapo.training.tensorboard_writer import TensorBoardWriter, read_histogram_tags, read_scalars

    steps = metrics_rows(steps=6)
    steps[1]["loss"] = float("nan")  # a skipped step: no point, the flag says it
    steps[1]["skipped"] = True
    with TensorBoardWriter(tmp_path / "tb") as writer:
        written = [writer.log_step(row) for row in steps]
        for row in selection_rows(epochs=2):
            writer.log_selection(row)

    scalars = read_scalars(tmp_path / "tb")
    assert written[:2] == [16, 15]  # 5 timings, 5 unlabeled and 6 other values; step 2's NaN loss left out
    assert "step" not in scalars  # the x axis, not a curve
    assert [s for s, _ in scalars["loss"]] == [1, 3, 4, 5, 6]
    assert scalars["skipped"] == [(s, float(s == 2)) for s in range(1, 7)]
    assert scalars["timing/rollout"][0] == (1, pytest.approx(0.5))
    assert scalars["timing/save"] == [(6, pytest.approx(0.7))]
    assert scalars["eval/mean"] == [(6, pytest.approx(0.5))]
    assert [s for s, _ in scalars["selection/precision_rejected"]] == [3, 6]
    assert "selection/tcs_selected" in scalars  # epoch 2 >= warm-up 1
    # per-epoch rows at step = epoch: questions i = 0, 1, 2 of 12 selected, i = 2 (i % 3 == 2) wrong;
    # rejected i = 3..11 without i = 5 (unknown): 8 known, i = 8 and 11 wrong
    assert scalars["selection_epoch/size"] == [(1, 3.0), (2, 3.0)]
    assert scalars["selection_epoch/share"][0][1] == pytest.approx(0.25)
    assert scalars["selection_epoch/precision_selected"][0][1] == pytest.approx(2 / 3)
    assert scalars["selection_epoch/precision_rejected"][0][1] == pytest.approx(6 / 8)
    assert scalars["selection_epoch/tcs_cut"][0][1] == pytest.approx(0.833)
    assert scalars["selection_epoch/reference_pass_rate"][1] == (2, pytest.approx(0.3))
    hist = read_histogram_tags(tmp_path / "tb")
    assert hist["selection_epoch/tcs"] == [1, 2]
    assert hist["selection_epoch/tcs_right_pseudo_label"] == [1, 2]
    assert hist["selection_epoch/tcs_wrong_pseudo_label"] == [1, 2]


def test_flatten_scalars_rules():
    from trapo.training.tensorboard_writer import flatten_scalars

    values = {
        "a": 1,
        "b": True,
        "c": None,
        "d": float("inf"),
        "e": "text",
        "f": [1, 2],
        "g": {"h": 2.5, "i": {"j": torch.tensor(3.0)}, "k": None},
    }
    assert flatten_scalars(values) == {"a": 1.0, "b": 1.0, "g/h": 2.5, "g/i/j": 3.0}


def test_missing_tensorboardx_names_the_config_key(monkeypatch):
    from trapo.config import ConfigError
    from trapo.training.tensorboard_writer import TensorBoardWriter

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match="logging.tensorboard"):
        TensorBoardWriter("unused")


def test_header_says_epochs_vary_under_dynamic_sampling(tmp_path):
    rows = metrics_rows()
    per_epoch = max(sum(r["epoch"] == e for r in rows) for e in {r["epoch"] for r in rows})
    assert f"{per_epoch} steps per epoch" in report.write_report(make_run(tmp_path)).read_text()
    for r in rows:  # refills consume batches: the longest epoch is only an upper bound
        r["dynamic_sampling"] = {"rounds": 1}
    text = report.write_report(make_run(tmp_path, metrics=rows, name="ds")).read_text()
    assert f"up to {per_epoch} steps per epoch" in text
