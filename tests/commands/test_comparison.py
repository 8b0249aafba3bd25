"""The comparison report (trapo/commands/reproduce/comparison.py) on hand-written runs: test accuracy at the best
validation step per condition, the paired claims, what the runs that bought labels bought, an untrained
condition's one evaluation, the selection's precision (the paper's Figure 4), the page and plot."""

import dataclasses
import json
import os

import pytest

from trapo.commands.reproduce import comparison
from trapo.commands.reproduce.study import load_study
from trapo.commands.reproduce.study_file import SPLITS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run(run_dir, evals, bought=()):
    """metrics.jsonl with evals {step: (validation, test, test_ood)}; labels.jsonl rows of `bought`
    (questions, whether each one's pseudo-label was right)."""
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "eval": dict(zip(SPLITS, v))} for s, v in sorted(evals.items())]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if bought:
        log = [{"step": 2, "epoch": 1, "question": q, "pseudo_correct": c} for q, c in bought]
        (run_dir / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return run_dir


def study():
    full = load_study(os.path.join(ROOT, "configs", "studies", "toy", "label_efficient.yaml"))
    keep = ("trapo", "ttrl", "labels_care", "labels_random")
    claims = [c for c in full.claims if c["better"] in keep and c["worse"] in keep]
    return dataclasses.replace(full, conditions={k: full.conditions[k] for k in keep}, claims=claims, steps=4)


def test_claims_read_the_test_accuracy_at_the_best_validation_step_and_purchases_are_summed(tmp_path):
    dirs = {}
    for seed, shift in ((0, 0.0), (1, 0.02), (2, 0.04)):
        # TraPO's best validation is step 2 (ID test 0.5 + shift), TTRL's step 4 (0.4 + shift): +0.1 every seed
        dirs[("trapo", seed)] = write_run(tmp_path / f"t{seed}", {2: (0.6, 0.5 + shift, 0.3), 4: (0.5, 0.9, 0.9)})
        dirs[("ttrl", seed)] = write_run(tmp_path / f"m{seed}", {2: (0.4, 0.9, 0.9), 4: (0.5, 0.4 + shift, 0.2)})
        # CARE bought 4, 3 of them where the vote was wrong; random 4, 1 wrong, one unknown
        care = [([10, 11], [False, False]), ([12, 13], [False, True])]
        dirs[("labels_care", seed)] = write_run(tmp_path / f"c{seed}", {4: (0.5, 0.6, 0.3)}, care)
        rand = [([20, 21], [True, True]), ([22, 23], [False, None])]
        dirs[("labels_random", seed)] = write_run(tmp_path / f"r{seed}", {4: (0.5, 0.55 + shift, 0.3)}, rand)
    text = comparison.write_report(study(), {k: comparison.run_values(d) for k, d in dirs.items()}, tmp_path / "docs")
    res = json.loads((tmp_path / "docs" / "label_efficient.json").read_text())
    claims = {c["name"]: c for c in res["claims"]}
    assert [round(d, 9) for d in claims["trapo_beats_ttrl"]["differences"]] == [0.1] * 3
    assert claims["trapo_beats_ttrl"]["verdict"] == "held"  # a constant difference: a zero-width interval
    assert [round(d, 9) for d in claims["trapo_beats_ttrl_ood"]["differences"]] == [0.1] * 3
    assert [round(d, 9) for d in claims["care_beats_random_labels"]["differences"]] == [0.05, 0.03, 0.01]
    care, rand = res["conditions"]["labels_care"], res["conditions"]["labels_random"]
    assert care["bought"]["mean"] == 4 and care["bought_wrong_vote"]["mean"] == 0.75
    assert rand["bought_wrong_vote"]["mean"] == pytest.approx(1 / 3)  # the unknown one left out
    assert "bought" not in res["conditions"]["trapo"]
    assert "| labels_care | 0, 1, 2 | 50.0% | 4 | 60.0% | 30.0% | 4 | 75.0% |" in text
    assert "| trapo | 0, 1, 2 | 60.0% | 2 | 52.0% | 30.0% | - | - |" in text
    assert "was wrong, so that the label changed its rewards: labels_care 75.0%, labels_random 33.3%." in text
    assert (
        "What this scale can and cannot separate" in text and (tmp_path / "docs" / "label_efficient.png").stat().st_size
    )
    assert "Every condition has 64 gold labels: up front, or 48 up front and 16 bought during training." in text
    assert "selection's precision" not in text  # no run selected


def test_a_condition_without_runs_leaves_its_claims_not_run(tmp_path):
    dirs = {("trapo", 0): write_run(tmp_path / "t", {4: (0.5, 0.5, 0.5)})}
    res = comparison.analyse(study(), {k: comparison.run_values(d) for k, d in dirs.items()}, [0])
    assert {c["verdict"] for c in res["claims"]} == {"not run"} and list(res["conditions"]) == ["trapo"]
    assert "Too few seeds" in comparison.page(res)


def test_an_untrained_condition_and_the_selection_precision_of_the_real_model_study(tmp_path):
    """configs/studies/real/comparison.yaml's report: the base model's row is its one evaluation (`trapo eval`'s
    results.json); the selection rows of TraPO's runs are pooled over seeds and epoch ends, by hand below."""
    full = load_study(os.path.join(ROOT, "configs", "studies", "real", "comparison.yaml"))
    keep = ("base", "trapo")
    real = dataclasses.replace(
        full,
        conditions={k: full.conditions[k] for k in keep},
        claims=[c for c in full.claims if c["better"] in keep and c["worse"] in keep],
    )
    tcs = [i / 10 for i in range(10)]  # the gate selects the top three (tcs 0.7, 0.8, 0.9)
    picked = [i >= 7 for i in range(10)]
    rows = {  # seed 0: 10 votes known, top and bottom 10% one question each; seed 1: 9 known, no deciles
        0: {"epoch": 3, "tcs": tcs, "selected": picked, "pseudo_correct": [0, 0, 1, 0, 1, 1, 0, 1, 1, 1]},
        1: {"epoch": 3, "tcs": tcs, "selected": picked, "pseudo_correct": [1, 0, 0, 0, 0, 0, 0, 0, None, 0]},
    }
    dirs = {}
    for seed in (0, 1):
        base = tmp_path / f"base{seed}"
        base.mkdir()
        scores = {"validation": 0.25, "test": 0.2, "test_ood": 0.1}
        (base / "results.json").write_text(json.dumps({"results": {k: {"score": v} for k, v in scores.items()}}))
        dirs[("base", seed)] = base
        trapo = write_run(tmp_path / f"trapo{seed}", {5: (0.3, 0.25 + seed / 10, 0.1), 10: (0.2, 0.9, 0.9)})
        row = {**rows[seed], "pseudo_correct": [None if c is None else bool(c) for c in rows[seed]["pseudo_correct"]]}
        (trapo / "selection.jsonl").write_text(json.dumps(row) + "\n")
        dirs[("trapo", seed)] = trapo
    text = comparison.write_report(real, {k: comparison.run_values(d) for k, d in dirs.items()}, tmp_path / "docs")
    res = json.loads((tmp_path / "docs" / "real_comparison.json").read_text())
    assert res["conditions"]["base"]["best_step"]["per_seed"] == [0, 0]
    assert [round(d, 9) for d in res["claims"][0]["differences"]] == [0.05, 0.15]  # trapo_beats_base, ID test
    sel = res["selection"]["trapo"]
    assert sel["epoch_ends"] == 2 and sel["top10"] == {"right": 1.0, "of": 1} and sel["bottom10"]["right"] == 0.0
    assert sel["selected"] == {"right": 0.6, "of": 5} and sel["rejected"] == {"right": 4 / 14, "of": 14}
    assert "| trapo | 2 | 100.0% of 1 | 0.0% of 1 | 60.0% of 5 | 28.6% of 14 |" in text
    assert "| base | 0, 1 | 25.0% | 0 | 20.0% | 10.0% | - | - |" in text and "base" not in res["selection"]
    assert "the paper's effect sizes" in text  # the study's scope
