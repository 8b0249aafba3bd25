"""One step's statistics: sums per rank, values after the cross-rank sum (hand-computed), files, summary."""

import json
import math

import pytest

from trapo.data import Question
from trapo.engine.policy import UPDATE_SUMS
from trapo.engine.rollout import Rollout
from trapo.training.grading import Grades
from trapo.training.metrics import run_summary, step_sums, step_values, step_warnings, summary_text, trim_metrics


def q(labeled: bool) -> Question:
    return Question(uid="x", question="1+1=", answer="2", labeled=labeled, messages=None, where="row 1")


def rollouts(*lengths_truncated):
    return [[Rollout(token_ids=[0] * n, text="", truncated=t) for n, t in group] for group in lengths_truncated]


def test_step_sums_by_name():
    questions = [q(True), q(False), q(True), q(False)]
    grades = Grades(
        rewards=[[1, 0], [1, 1], [0, 0], [1, 0]],
        pass_rates=[0.5, 1.0, 0.0, 0.5],
        pseudo_correct=[math.nan, 1.0, math.nan, math.nan],  # the second unlabeled one has no hidden gold
        timeouts=2,
        budget_cut=5,
        failed=1,
    )
    gate = [1.0, 1.0, 1.0, 0.0]
    sums = step_sums(questions, grades, gate, rollouts([(3, False), (5, True)], [(2, False)] * 2, [(4, True)] * 2, []))
    assert sums == {
        "labeled_questions": 2,
        "labeled_pass_sum": 0.5,
        "unlabeled_questions": 2,
        "unlabeled_pass_sum": 1.5,
        "unlabeled_reward_sum": 1.0 + 0.5,  # the unlabeled questions' mean rewards
        "unlabeled_in_loss": 1.0,
        "pseudo_known": 1,
        "pseudo_right": 1.0,
        "response_tokens": 3 + 5 + 2 + 2 + 4 + 4,
        "truncated": 3,
        "responses": 6,
        "grading_timeouts": 2,
        "grading_budget_cut": 5,
        "grading_failed": 1,
    }


def totals(**kw):
    base = dict.fromkeys(UPDATE_SUMS, 0.0)
    base.update(
        labeled_questions=4,
        labeled_pass_sum=3.0,
        unlabeled_questions=8,
        unlabeled_pass_sum=2.0,
        unlabeled_reward_sum=2.0,
        unlabeled_in_loss=5,
        pseudo_known=4,
        pseudo_right=3.0,
        response_tokens=1000,
        truncated=6,
        responses=96,
        grading_timeouts=0,
        grading_budget_cut=0,
        grading_failed=0,
    )
    base.update(kw)
    return base


def test_step_values_from_cross_rank_totals():
    t = totals(
        loss=1.2,
        pg_loss=0.8,
        entropy=50.0,
        clip_frac=10.0,
        trained_tokens=200.0,
        trained_sequences=72.0,
        logprob_diff=0.5,
        logprob_tokens=200.0,
    )
    v = step_values(t, world=2, updates=3, applied=True, unlabeled=True)
    assert v["loss"] == pytest.approx(1.2 / 2 / 3) and v["pg_loss"] == pytest.approx(0.8 / 2 / 3)
    assert v["entropy"] == pytest.approx(0.25) and v["clip_frac"] == pytest.approx(0.05)  # token-weighted
    assert v["trained_sequences"] == 72 and v["logprob_diff_rollout_vs_policy"] == pytest.approx(0.0025)
    assert v["reward_labeled"] == v["pass_rate_labeled"] == 0.75
    assert v["pass_rate_unlabeled"] == v["reward_unlabeled"] == 0.25
    assert v["unlabeled_in_loss"] == 5 and v["pseudo_label_precision"] == 0.75
    assert v["response_tokens"] == 1000 and v["truncated_frac"] == 6 / 96 and v["skipped"] is False


def test_step_values_edge_cases():
    skipped = step_values(totals(), world=1, updates=1, applied=False, unlabeled=False)
    assert math.isnan(skipped["loss"]) and skipped["skipped"] is True
    assert skipped["reward_unlabeled"] is None  # a run without unlabeled rewards (mode supervised)
    assert skipped["entropy"] == 0.0  # no trained tokens: no division by zero
    assert skipped["logprob_diff_rollout_vs_policy"] is None  # no engine log-probs
    empty = step_values(
        totals(labeled_questions=0, unlabeled_questions=0, pseudo_known=0),
        world=1,
        updates=1,
        applied=True,
        unlabeled=True,
    )
    assert empty["reward_labeled"] is None and empty["pass_rate_unlabeled"] is None
    assert empty["pseudo_label_precision"] is None
    assert empty["kl_ref"] is None  # loss.beta = 0: no reference model, no KL logged
    kl = step_values(totals(kl_ref=0.3, kl_tokens=200.0), world=1, updates=1, applied=True, unlabeled=True)
    assert kl["kl_ref"] == pytest.approx(0.0015)  # token-weighted mean


def test_trim_metrics_moves_redone_steps_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5')
    trim_metrics(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    discarded = (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()
    assert discarded[:2] == ['{"step": 3}', '{"step": 4}'] and discarded[2] == '{"step": 5'


def test_summary_text():
    text = summary_text(
        {
            "steps": 80,
            "heldout_accuracy_before": 0.5,
            "heldout_accuracy_after": 0.625,
            "selection": {
                "selected": 19,
                "unlabeled": 192,
                "database": 111,
                "precision_selected": 0.84,
                "precision_rejected": None,
            },
        }
    )
    assert text.splitlines() == [
        "trained 80 steps",
        "held-out accuracy: 0.500 before -> 0.625 after",
        "unlabeled selected at the last epoch end: 19 of 192 (database 111)",
        "pseudo-label precision: selected 0.84, rejected -",
    ]


def test_summary_with_avg_at_k_round_trips_through_json_and_names_k_and_temperatures():
    before, after = {"test": 0.5, "mean": 0.5}, {"test": 0.625, "mean": 0.625}
    avg = {"k": 8, "temperature": 0.6, "before": {"test": 0.25, "mean": 0.25}, "after": {"test": 0.75, "mean": 0.75}}
    summary = json.loads(
        json.dumps(run_summary(80, before, after, None, None, temperature=0.0, avg=avg, cpu_kernels="AVX2"))
    )
    # the keys older readers take (report, readme, the long-run study) keep their meaning: greedy pass@1
    assert (summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]) == (0.5, 0.625)
    assert summary["heldout_before"] == before and summary["cpu_kernels"] == "AVX2"
    assert (summary["heldout_avg_before"], summary["heldout_avg_after"]) == (0.25, 0.75)
    assert summary_text(summary).splitlines() == [
        "trained 80 steps",
        "held-out accuracy (greedy): 0.500 before -> 0.625 after",
        "held-out avg@8 (temperature 0.6): 0.250 before -> 0.750 after",
    ]
    sampled = run_summary(3, None, after, None, None, temperature=0.3)  # resumed from a run without `before`
    assert "heldout_avg" not in sampled
    assert summary_text(sampled).splitlines() == ["trained 3 steps", "held-out accuracy (temperature 0.3) after: 0.625"]


def test_step_warnings_for_truncation_and_grading_storms():
    quiet = step_values(totals(truncated=19), world=1, updates=1, applied=True, unlabeled=True)
    assert step_warnings({**quiet, "step": 3}) == []  # 19 of 96 truncated: under 20%
    loud = step_values(
        totals(truncated=20, grading_timeouts=5), world=1, updates=1, applied=True, unlabeled=True
    )  # 5 timeouts in 96 responses: over 5%
    kinds = [kind for kind, _ in step_warnings({**loud, "step": 3})]
    assert kinds == ["truncation", "grading"]
    cut = step_values(totals(grading_budget_cut=1), world=1, updates=1, applied=True, unlabeled=True)
    ((kind, message),) = step_warnings({**cut, "step": 7})
    assert kind == "grading" and "step 7: 0 Math-Verify timeouts and 1 comparisons cut" in message


def test_append_jsonl_creates_the_run_directory(tmp_path):
    from trapo.training.metrics import append_jsonl

    path = tmp_path / "run" / "selection.jsonl"  # a step may end an epoch before train() made the directory
    append_jsonl(path, {"epoch": 1})
    append_jsonl(path, {"epoch": 2})
    assert [json.loads(x)["epoch"] for x in path.read_text().splitlines()] == [1, 2]
