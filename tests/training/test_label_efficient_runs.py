"""The label-efficient methods as configurations of the trainer, on the toy: EMPO's cluster-share reward
(reward.unlabeled=cluster_share), SCRL's (scrl) and labels bought during training (labels.*) train and resume
exactly."""

import json

import pytest
from toyrun import metrics, overrides, rows, stopped_at, train

pytestmark = pytest.mark.toy_run
RUN = dict(mode="naive_semi", max_steps=8, save_steps=4)


def test_cluster_share_trains_8_steps_and_resumes_exactly_after_a_stop(toy_dir, tmp_path):
    empo = {**RUN, "reward.unlabeled": "cluster_share"}
    train(overrides(toy_dir, tmp_path, run_name="empo", **empo))
    m = metrics(tmp_path / "empo")
    assert [row["step"] for row in m] == list(range(1, 9)) and not any(row["skipped"] for row in m)
    # the mean share of an answer's cluster: at least the pass rate squared over the majority alone, at most 1
    for row in m:
        assert row["pass_rate_unlabeled"] ** 2 <= row["reward_unlabeled"] + 1e-9 <= 1.0 + 1e-9
    assert any(row["reward_unlabeled"] != row["pass_rate_unlabeled"] for row in m)  # not majority agreement
    stopped_at(tmp_path / "empo", tmp_path / "resumed", 4)
    train(overrides(toy_dir, tmp_path, run_name="resumed", resume_from="latest", **empo))
    assert rows(tmp_path / "resumed") == rows(tmp_path / "empo")


def test_scrl_trains_8_steps_and_resumes_exactly_after_a_stop(toy_dir, tmp_path):
    scrl = {**RUN, "reward.unlabeled": "scrl"}
    train(overrides(toy_dir, tmp_path, run_name="scrl", **scrl))
    m = metrics(tmp_path / "scrl")
    assert [row["step"] for row in m] == list(range(1, 9)) and not any(row["skipped"] for row in m)
    # +1 / 0 / -1 rewards: never above the share of answers in a strong majority, and not the majority agreement
    assert all(-1.0 <= row["reward_unlabeled"] <= row["pass_rate_unlabeled"] + 1e-9 for row in m)
    assert any(row["reward_unlabeled"] != row["pass_rate_unlabeled"] for row in m)
    stopped_at(tmp_path / "scrl", tmp_path / "resumed", 4)
    train(overrides(toy_dir, tmp_path, run_name="resumed", resume_from="latest", **scrl))
    assert rows(tmp_path / "resumed") == rows(tmp_path / "scrl")


@pytest.mark.parametrize("acquire", ["care", "tcs", "random"])
def test_bought_labels_stay_within_budget_train_as_labeled_and_resume_exactly(toy_dir, tmp_path, acquire):
    """16 labeled + 48 unlabeled toy questions, 2 steps per epoch, 8 steps: labels bought at the ends of epochs 1-3,
    2 each (budget 6 spread), chosen by `acquire` (CARE's score reads the epoch's votes and the labeled groups'
    calibration). A stop at step 3, mid-epoch, resumes with what the epoch recorded and buys the same."""
    bought = {
        "mode": "trapo",
        "max_steps": 8,
        "save_steps": 3,
        "train.rollout_batch_size": 32,
        "train.update_batch_size": 32,
        "labels.budget": 6,
        "labels.acquire": acquire,
    }
    train(overrides(toy_dir, tmp_path, run_name="care", **bought))
    log = [json.loads(line) for line in (tmp_path / "care" / "labels.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"], len(r["question"]), r["spent"]) for r in log] == [
        (2, 1, 2, 2),
        (4, 2, 2, 4),
        (6, 3, 2, 6),
    ]
    questions = [q for r in log for q in r["question"]]
    assert len(set(questions)) == 6 and all(
        q >= 16 for q in questions
    )  # unlabeled ones, each once (toy: labeled first)
    m = metrics(tmp_path / "care")
    # every question is rolled out once an epoch: the labeled ones are the 16, and the ones bought before it
    per_epoch = [m[2 * e]["labeled_questions"] + m[2 * e + 1]["labeled_questions"] for e in range(4)]
    assert per_epoch == [16, 18, 20, 22]
    stopped_at(tmp_path / "care", tmp_path / "resumed", 3)
    train(overrides(toy_dir, tmp_path, run_name="resumed", resume_from="latest", **bought))
    assert rows(tmp_path / "resumed") == rows(tmp_path / "care")
    assert (tmp_path / "resumed" / "labels.jsonl").read_text() == (tmp_path / "care" / "labels.jsonl").read_text()
