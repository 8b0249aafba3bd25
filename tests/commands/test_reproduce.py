"""The reproduction's statistics, protocol read-out and Figure 4 by hand; its smallest configuration end to end."""

import json
import math
import os
import sys

import pytest
from toyrun import run

from trapo import runtime
from trapo.commands import reproduce as rp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("df, expected", [(1, 12.7062), (4, 2.7764), (7, 2.3646), (30, 2.0423)])
def test_t_quantile_matches_tables(df, expected):
    assert rp.t_quantile(0.975, df) == pytest.approx(expected, abs=2e-4)
    assert rp.t_cdf(expected, df) == pytest.approx(0.975, abs=1e-5)
    assert rp.t_cdf(-expected, df) == pytest.approx(0.025, abs=1e-5)


def test_paired_interval_by_hand():
    diffs = [0.1, 0.2, 0.3, 0.4]  # mean 0.25, sd sqrt(1/60), df 3: t = 3.1824
    ci = rp.paired_interval(diffs)
    half = 3.1824 * math.sqrt(0.05 / 3) / 2
    assert ci["mean"] == pytest.approx(0.25)
    assert ci["low"] == pytest.approx(0.25 - half, abs=1e-4) and ci["high"] == pytest.approx(0.25 + half, abs=1e-4)
    assert rp.verdict(ci) == "held"
    assert rp.verdict(rp.paired_interval([-x for x in diffs])) == "not held"
    assert rp.verdict(rp.paired_interval([0.1, -0.1, 0.05, -0.02])) == "inconclusive"
    assert rp.verdict(ci, threshold=0.5) == "not held"  # the whole interval (0.045, 0.455) is below 0.5
    one = rp.paired_interval([0.3])  # one seed: no interval, never a verdict either way
    assert one["low"] == -math.inf and rp.verdict(one) == "inconclusive"


def test_budgets_follow_each_protocol():
    plan = rp.budgets(16)
    assert plan["equal_epochs"]["supervised"] == 16 and plan["equal_epochs"]["trapo"] == 64
    assert all(v == 64 for v in plan["equal_steps"].values())


def test_read_out_rules():
    curve = [
        {"step": 4, "validation": 0.30, "test": 0.10, "test_ood": 0.5},
        {"step": 8, "validation": 0.40, "test": 0.20, "test_ood": 0.4},
        {"step": 12, "validation": 0.40, "test": 0.90, "test_ood": 0.3},  # tie: the earlier step wins
        {"step": 16, "validation": 0.35, "test": 0.30, "test_ood": 0.2},
        {"step": 20, "validation": 0.90, "test": 0.99, "test_ood": 0.1},  # past a 16-step budget
    ]
    assert rp.read_out(curve, 16, "best_validation")["step"] == 8
    assert rp.read_out(curve, 16, "last")["test"] == 0.30
    assert rp.read_out(curve, 20, "best_validation")["step"] == 20
    with pytest.raises(ValueError, match="no evaluation at step 14"):
        rp.read_out(curve, 14, "last")


def test_figure4_deciles_and_random_control():
    # 20 known pseudo-labels: k = 2 per decile. TCS order: the two highest right, of the two lowest one right.
    tcs = list(range(20))
    correct = [True, False] + [False] * 16 + [True, True]
    row = {"epoch": 3, "tcs": tcs + [5.0], "pseudo_correct": correct + [None], "selected": [False] * 21}
    top, bottom = rp.decile_accuracy(row)
    assert top == [True, True] and sorted(bottom) == [False, True]
    rand = {"epoch": 3, "tcs": [0.0] * 4, "pseudo_correct": [True, False, None, True], "selected": [1, 1, 1, 0]}
    assert rp.selected_accuracy(rand) == [True, False]
    fig = rp.figure4([row, {**row, "epoch": 4}], [rand])
    assert fig["top10"] == 1.0 and fig["bottom10"] == 0.5
    assert fig["random"] == 0.5  # epoch 4 has no random row: only epoch 3's two picks count
    assert [e["epoch"] for e in fig["per_epoch"]] == [3, 4] and math.isnan(fig["per_epoch"][1]["random"])
    assert rp.decile_accuracy({"tcs": [1.0] * 9, "pseudo_correct": [True] * 9}) is None


def test_analyse_pairs_methods_within_seeds():
    def curve(test):  # evaluated every 4 steps up to 16; validation peaks at step 8
        return [
            {"step": s, "validation": v, "test": test + s / 100, "test_ood": 0.1}
            for s, v in zip((4, 8, 12, 16), (0.1, 0.5, 0.2, 0.3))
        ]

    data = {}
    for s, gain in ((0, 0.05), (1, 0.07), (2, 0.06)):
        data[("supervised", s)] = {"curve": curve(0.2), "selection": []}
        data[("trapo", s)] = {"curve": curve(0.2 + gain), "selection": []}
    res = rp.analyse(data, [0, 1, 2], epochs=4, base={"validation": 0, "test": 0, "test_ood": 0})
    sup = res["protocols"]["equal_epochs"]["methods"]["supervised"]
    assert sup["steps"] == 4 and sup["last"]["step"] == [4, 4, 4]
    assert res["protocols"]["equal_steps"]["methods"]["supervised"]["best_validation"]["step"] == [8, 8, 8]
    claims = {(c["claim"], c["protocol"], c["rule"]): c for c in res["claims"]}
    # equal epochs, last: trapo at step 16 vs supervised at step 4 -> gain + 0.12
    c = claims[("trapo_beats_supervised_id", "equal_epochs", "last")]
    assert c["differences"] == pytest.approx([0.17, 0.19, 0.18]) and c["verdict"] == "held"
    c = claims[("trapo_beats_supervised_ood", "equal_steps", "last")]
    assert c["differences"] == [0.0, 0.0, 0.0] and c["verdict"] == "inconclusive"
    md = rp.markdown(res)
    assert "| TraPO | 16 |" in md and "| Supervised, 64 labeled only | 4 |" in md


@pytest.mark.toy_run
def test_reproduce_smallest_configuration(tmp_path):
    env = runtime.subprocess_env()
    out = tmp_path / "rep"
    cmd = [
        sys.executable,
        "-m",
        "trapo",
        "reproduce",
        "--tiny",
        "--epochs",
        "4",
        "--seeds",
        "0,1",
        "--methods",
        "supervised,trapo,trapo_ood",  # trapo_random differs from trapo only in a selection override
        "--out",
        str(out),
        "rollout.backend=hf",  # what the runner does, not what vLLM does: the hf backend starts in half the time
    ]
    done = run(
        cmd, timeout=900, env=env
    )  # forked from the tests' pre-imported parent: the base model's build needs torch
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("results.md", "results.json", "accuracy_over_steps.png", "figure4.png", "paired_differences.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0, 1] and set(res["protocols"]) == {"equal_epochs", "equal_steps"}
    assert res["protocols"]["equal_epochs"]["methods"]["supervised"]["steps"] == 4
    assert res["protocols"]["equal_epochs"]["methods"]["trapo"]["steps"] == 16
    assert {c["verdict"] for c in res["claims"]} <= {"held", "not held", "inconclusive"}
    assert any(c["claim"] == "ood_setting_trapo_beats_supervised_id" for c in res["claims"])
    # every run validated on the validation split, and picked its best checkpoint by it alone
    best = json.loads((out / "runs" / "trapo-seed0" / "best.json").read_text())
    evals = [
        json.loads(x).get("eval") for x in (out / "runs" / "trapo-seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert best["score"] == max(e["validation"] for e in evals if e)
    # the OOD setting trains on the ID setting's labeled questions plus unlabeled additions
    ood_rows = [json.loads(x) for x in (out / "splits" / "ood-seed0.jsonl").read_text().splitlines()]
    assert sum(r["labeled"] for r in ood_rows) == 16 and all("+" in r["question"] for r in ood_rows if not r["labeled"])
    # rerunning reuses the finished runs, but not under another budget
    again = run(cmd, timeout=900, env=env)
    assert again.returncode == 0 and again.stderr.count("reusing") == 6
    other = run([*cmd[:6], "2", cmd[7], "0", "--methods", "trapo", *cmd[11:]], timeout=900, env=env)  # 8 steps
    assert other.returncode == 0 and "ran 16 steps, not 8: running again" in other.stderr, other.stderr[-2000:]
