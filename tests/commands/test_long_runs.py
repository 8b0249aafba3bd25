"""The long-run study (configs/studies/long_runs.yaml) and its report (trapo/commands/reproduce/long_runs.py):
the file loads with its metric claims, a metric claim outside a report study is one line, and the report's
read-outs on hand-written runs are the hand-computed ones."""

import json

import pytest
import yaml

from trapo import runtime
from trapo.commands.reproduce.long_runs import analyse, page, run_values, write_report
from trapo.commands.reproduce.study import launches, load_study
from trapo.config import ConfigError

STUDY = runtime.ROOT / "configs" / "studies" / "long_runs.yaml"


def test_the_long_run_study_loads_with_five_conditions_three_seeds_and_metric_claims(tmp_path):
    study = load_study(STUDY)
    assert list(study.conditions) == ["default", "no_entropy", "token_mean", "adaptive", "soft_penalty"]
    assert study.seeds == [0, 1, 2] and study.report == "long_runs" and study.steps >= 200
    assert {c["metric"] for c in study.claims} == {"truncated", "accuracy", "precision"}
    runs = launches(study, tmp_path / "long_runs", study.seeds)
    assert len(runs) == 15 and all("rollout.rambling.stop_steps=null" in argv for *_, argv in runs)
    # toy_assets: base: configs/toy.yaml's own toy, built once beside the runs; no reproduction model or splits
    argv = runs[0][3]
    assert f"toy.dir={tmp_path / 'base-assets'}" in argv and not any(a.startswith("model.path") for a in argv)


def test_a_metric_claim_needs_a_report_and_a_known_metric(tmp_path):
    raw = yaml.safe_load(STUDY.read_text())
    for change, message in (
        (lambda r: r.pop("report"), "only a study with report: long_runs reads it"),
        (lambda r: r["claims"][0].update(metric="truncation"), "did you mean 'truncated'?"),
        (lambda r: r.update(report="long_run"), "did you mean 'long_runs'?"),
        (lambda r: r.update(toy_assets="bases"), "did you mean .base.?"),
        (lambda r: r["claims"][0].pop("metric"), "every claim needs a metric"),
    ):
        bad = yaml.safe_load(STUDY.read_text())
        change(bad)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=message) as err:
            load_study(path)
        assert "\n" not in str(err.value)
    assert raw["claims"][0]["metric"] == "truncated"


def fake_run(path, truncated, entropy, before, after, precision, warned_at=None):
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "truncated_frac": t, "entropy": e} for i, (t, e) in enumerate(zip(truncated, entropy))]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    selection = {"precision_selected": precision, "precision_rejected": 0.5}
    summary = {"heldout_before": {"test": before}, "heldout_after": {"test": after}, "selection": selection}
    (path / "summary.json").write_text(json.dumps(summary))
    if warned_at:
        (path / "log.txt").write_text(f"[trapo] warning: step {warned_at}: 33% ... the entropy bonus (...)\n")
    return path


def test_the_report_reads_each_run_and_each_claim_by_hand(tmp_path):
    study = load_study(STUDY)
    healthy = ([0.0] * 60, [0.1] * 60)
    rambling = ([0.0] * 10 + [0.3, 0.6] + [1.0] * 48, [0.1] * 10 + [0.5, 0.9] + [1.2] * 48)
    dirs = {}
    for seed, acc in ((0, 0.40), (1, 0.42), (2, 0.44)):
        dirs[("default", seed)] = fake_run(tmp_path / f"d{seed}", *rambling, 0.45, acc, 0.2, warned_at=11)
        for name in ("no_entropy", "token_mean", "adaptive", "soft_penalty"):
            dirs[(name, seed)] = fake_run(tmp_path / f"{name}{seed}", *healthy, 0.45, acc + 0.05, 0.8)
    v = run_values(dirs[("default", 0)])
    # the last 50 steps: steps 11-60, two of them below 1.0: median 1.0; entropy (0.5 + 0.9 + 48 x 1.2) / 50
    assert v["truncated"] == 1.0 and v["entropy"] == pytest.approx((0.5 + 0.9 + 48 * 1.2) / 50)
    assert (v["first_truncated_half"], v["guard_warning_step"]) == (12, 11)
    assert (v["accuracy_before"], v["accuracy"], v["precision"], v["precision_rejected"]) == (0.45, 0.40, 0.2, 0.5)
    values = {key: run_values(d) for key, d in dirs.items()}
    res = analyse(study, values, [0, 1, 2])
    claims = {c["name"]: c for c in res["claims"]}
    truncated = claims["token_mean_truncates_less"]["interval"]  # default 1.0 - token_mean 0.0, every seed
    assert (truncated["mean"], truncated["low"], claims["token_mean_truncates_less"]["verdict"]) == (1.0, 1.0, "held")
    assert claims["token_mean_keeps_accuracy"]["interval"]["mean"] == pytest.approx(0.05)
    assert claims["token_mean_selects_better"]["interval"]["mean"] == pytest.approx(0.6)
    text = page(res)
    assert "| default | 0, 1, 2 | 1.000 |" in text and "| 12, 12, 12 | 11, 11, 11 |" in text
    docs = tmp_path / "docs"
    assert write_report(study, {k: run_values(d) for k, d in dirs.items()}, docs) == (docs / "long-runs.md").read_text()
    assert (docs / "long-runs.png").stat().st_size > 0 and json.loads((docs / "long-runs.json").read_text())["runs"]


def test_a_report_of_some_runs_pairs_the_seeds_both_conditions_ran(tmp_path):
    """Seed 0 of every condition, seed 1 of default and token_mean only: each claim over the seeds both ran."""
    study = load_study(STUDY)
    dirs = {}
    for name in study.conditions:
        dirs[(name, 0)] = fake_run(tmp_path / f"{name}0", [0.2] * 60, [0.1] * 60, 0.45, 0.45, 0.5)
    dirs[("default", 1)] = fake_run(tmp_path / "default1", [0.9] * 60, [1.0] * 60, 0.45, 0.40, 0.5)
    dirs[("token_mean", 1)] = fake_run(tmp_path / "token_mean1", [0.1] * 60, [0.1] * 60, 0.45, 0.45, 0.5)
    res = analyse(study, {k: run_values(d) for k, d in dirs.items()}, [0, 1, 2])
    assert res["conditions"]["default"]["seeds"] == [0, 1] and res["conditions"]["adaptive"]["seeds"] == [0]
    claims = {c["name"]: c for c in res["claims"]}
    assert claims["token_mean_truncates_less"]["seeds"] == [0, 1]
    assert claims["token_mean_truncates_less"]["interval"]["mean"] == pytest.approx((0.0 + 0.8) / 2)
    assert claims["adaptive_truncates_less"]["seeds"] == [0]  # one pair: an unbounded interval
    assert claims["adaptive_truncates_less"]["verdict"] == "inconclusive"


def test_conditions_narrow_a_study_run_to_some_arms(tmp_path):
    from trapo.commands.reproduce.study import subset

    study = load_study(STUDY)
    two = subset(study, "default,token_mean")
    assert list(two.conditions) == ["default", "token_mean"]
    assert {c["name"] for c in two.claims} == {
        "token_mean_truncates_less",
        "token_mean_keeps_accuracy",
        "token_mean_selects_better",
    }
    with pytest.raises(ConfigError, match="'tokenmean' is not a condition"):
        subset(study, "default,tokenmean")
