"""The label-efficient methods as configurations of the trainer, on the toy: EMPO's cluster-share reward
(reward.unlabeled=cluster_share) trains and resumes exactly."""

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
