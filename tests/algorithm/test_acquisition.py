"""labels.*: CARE's advantage gap and its expectation by hand, the label buyer's budget (never exceeded, never a
question twice, only hidden golds), each score's choice, and the tracker's bought questions through a resume."""

import math

import pytest
import torch

from trapo.algorithm.acquisition import Calibration, GroupVote, LabelBuyer, advantage_gap, group_vote
from trapo.algorithm.passrate import PassRateTracker
from trapo.algorithm.rewards import Vote
from trapo.config import LabelsConfig, SelectionConfig


def test_advantage_gap_by_hand():
    """G = 4, pseudo-label on 2 responses, gold on 1 other. Pseudo rewards 1 1 0 0: mean 0.5, std 0.5, advantages
    1 1 -1 -1. Gold 0 0 1 0: mean 0.25, std sqrt(0.1875) = 0.4330, advantages -0.5774 -0.5774 1.7321 -0.5774.
    Difference 1.5774 1.5774 -2.7321 -0.4226: norm sqrt(2.4880 + 2.4880 + 7.4641 + 0.1786) = 3.5523."""
    assert advantage_gap(4, 2, 1) == pytest.approx(3.5523, abs=1e-4)
    # no response right: the gold advantages are all 0, so the gap is the pseudo advantages' norm, sqrt(G)
    assert advantage_gap(4, 2, 0) == pytest.approx(2.0)
    # a unanimous wrong vote moves nothing (equal rewards: advantages 0 both ways); neither does an empty one
    assert advantage_gap(4, 4, 0) == 0.0 and advantage_gap(4, 0, 0) == 0.0
    # 5 voted, the other 3 right: the advantages swap sides, sqrt(5 x (2 x 0.7746)^2 + 3 x (2 x 1.2910)^2)
    assert advantage_gap(8, 5, 3) == pytest.approx(math.sqrt(32))
    with pytest.raises(ValueError, match="x \\+ y <= g"):
        advantage_gap(4, 3, 2)


def test_the_calibration_estimates_both_unknowns_from_labeled_groups():
    cal = Calibration(4)
    assert cal.p_wrong(2) == 0.5 and cal.p_none_right() == 0.5  # add-one smoothing of no evidence
    cal.add(GroupVote(2, (1, 1)), right=False, n_right=1)  # the vote of 2 was wrong, one response right
    cal.add(GroupVote(2, (2,)), right=True, n_right=2)
    cal.add(GroupVote(3, (1,)), right=False, n_right=0)  # wrong, none right
    assert cal.p_wrong(2) == (1 + 1) / (2 + 2) and cal.p_wrong(3) == (1 + 1) / (1 + 2) and cal.p_wrong(0) == 1.0
    assert cal.p_none_right() == (1 + 1) / (2 + 2)
    # E[gap] of a vote of 2 beside clusters of 1 and 1: P(wrong) 0.5 x [P(none right) 0.5 x gap(4, 2, 0)
    # + 0.5 x (1/2 gap(4, 2, 1) + 1/2 gap(4, 2, 1))] = 0.5 x (0.5 x 2 + 0.5 x 3.5523)
    assert cal.expected_gap(GroupVote(2, (1, 1))) == pytest.approx(0.5 * (0.5 * 2.0 + 0.5 * 3.5523), abs=1e-4)
    # no other cluster: a wrong vote has none right; unanimity costs nothing
    assert cal.expected_gap(GroupVote(4, ())) == 0.0


def test_group_vote_reads_the_pseudo_labels_cluster_and_the_others():
    v = Vote("7", [True, True, False, True, False, False], [0.5] * 6, [0, 0, 1, 0, 2, None])
    assert group_vote(v) == GroupVote(3, (1, 1))
    tie = Vote(None, [False] * 4, [0.5] * 4, [0, 0, 1, 1])
    assert group_vote(tie) == GroupVote(0, (2, 2))


def tracker(labeled: list[bool]) -> PassRateTracker:
    t = PassRateTracker(torch.tensor(labeled), SelectionConfig(warmup_epochs=1, top_p=0.1, threshold=0.99))
    return t


def close_epoch(t: PassRateTracker, rates: list[float]) -> None:
    t.record(torch.arange(len(rates)), torch.tensor(rates))
    t.end_epoch()


def test_the_budget_is_never_exceeded_and_nothing_is_bought_twice():
    """8 questions, 2 labeled, one unlabeled without a hidden gold: budget 4 at 3 per epoch buys 3, then 1,
    then nothing, never question 7 (no gold) nor a labeled one."""
    labeled = [True, True] + [False] * 6
    t = tracker(labeled)
    gold = torch.tensor([True] * 7 + [False])
    buyer = LabelBuyer(LabelsConfig(budget=4, per_epoch=3, acquire="random"), 8, gold, seed=0, buy_epochs=5)
    bought = []
    for _ in range(4):
        close_epoch(t, [0.5] * 8)
        row = buyer.buy(t)
        bought.append([] if row is None else row["question"])
        if row is not None:
            assert row["spent"] == int(t.bought.sum()) <= 4 and row["budget"] == 4
    assert [len(b) for b in bought] == [3, 1, 0, 0]
    flat = [q for b in bought for q in b]
    assert len(set(flat)) == 4 and not set(flat) & {0, 1, 7}
    assert t.gate(torch.tensor(flat)).tolist() == [1.0] * 4  # labeled now
    # the same seed buys the same questions in the same order; another seed, another order
    again = LabelBuyer(LabelsConfig(budget=4, per_epoch=3, acquire="random"), 8, gold, seed=0, buy_epochs=5)
    t2 = tracker(labeled)
    close_epoch(t2, [0.5] * 8)
    assert again.buy(t2)["question"] == bought[0]


def test_the_budget_is_spread_over_the_epochs_that_buy():
    gold = torch.ones(10, dtype=torch.bool)
    assert LabelBuyer(LabelsConfig(budget=7), 8, gold, 0, buy_epochs=3).per_epoch == 3  # ceil(7 / 3)
    assert LabelBuyer(LabelsConfig(budget=2), 8, gold, 0, buy_epochs=5).per_epoch == 1
    assert LabelBuyer(LabelsConfig(budget=4), 8, gold, 0, buy_epochs=0).per_epoch == 4  # a one-epoch run


def test_tcs_buys_the_least_trapo_like_trajectories():
    """Labeled trajectories rise 0.2 -> 0.8; unlabeled 2 rises too, 3 falls: after two epochs, 3 has the lower
    TCS to the database and is bought first."""
    t = tracker([True, True, False, False])
    close_epoch(t, [0.2, 0.2, 0.2, 0.8])
    close_epoch(t, [0.8, 0.8, 0.8, 0.2])
    buyer = LabelBuyer(LabelsConfig(budget=1, acquire="tcs"), 8, torch.ones(4, dtype=torch.bool), 0, 3)
    row = buyer.buy(t)
    assert row["question"] == [3] and row["score"][0] < 0


def test_care_buys_where_the_expected_advantage_error_is_largest():
    """Question 2: a vote of 7 of 8 beside 1; question 3: 3 of 8 beside clusters of 2, 2 and 1. Wrong, a vote of 7
    costs more (its advantages are the largest), so at the prior (no labeled group seen) 2 goes first. The
    labeled groups then show votes of 7 right 9 times in 10 and votes of 3 wrong 3 times in 4: 3 goes first."""
    gold = torch.ones(4, dtype=torch.bool)
    votes = {2: GroupVote(7, (1,)), 3: GroupVote(3, (2, 2, 1))}
    prior = LabelBuyer(LabelsConfig(budget=1, acquire="care"), 8, gold, 0, 3)
    t = tracker([True, False, False, False])
    for q, v in votes.items():
        prior.record(q, v, labeled=False, right=False, n_right=0)
    close_epoch(t, [1.0, 0.875, 0.875, 0.375])
    assert prior.buy(t)["question"] == [2]

    buyer = LabelBuyer(LabelsConfig(budget=1, acquire="care"), 8, gold, 0, 3)
    for n in range(10):
        buyer.record(0, GroupVote(7, (1,)), labeled=True, right=n > 0, n_right=7 if n else 1)
    for n in range(4):
        buyer.record(0, GroupVote(3, (3, 2)), labeled=True, right=n == 0, n_right=3 if n == 0 else 2)
    for q, v in votes.items():
        buyer.record(q, v, labeled=False, right=False, n_right=0)
    assert buyer.calibration.p_wrong(7) == 2 / 12 and buyer.calibration.p_wrong(3) == 4 / 6
    t = tracker([True, False, False, False])
    close_epoch(t, [1.0, 0.875, 0.875, 0.375])
    row = buyer.buy(t)
    assert row["question"] == [3]
    assert row["score"][0] == pytest.approx(buyer.calibration.expected_gap(votes[3]), abs=1e-5)
    assert buyer.calibration.expected_gap(votes[2]) < row["score"][0]


def test_bought_questions_and_the_calibration_survive_a_resume():
    labeled = [True, False, False, False]
    t = tracker(labeled)
    buyer = LabelBuyer(LabelsConfig(budget=2, per_epoch=1, acquire="care"), 4, torch.ones(4, dtype=torch.bool), 0, 3)
    buyer.record(0, GroupVote(3, (1,)), labeled=True, right=False, n_right=1)
    buyer.record(2, GroupVote(2, (1, 1)), labeled=False, right=False, n_right=0)
    close_epoch(t, [0.5] * 4)
    first = buyer.buy(t)
    t2, buyer2 = tracker(labeled), LabelBuyer(buyer.config, 4, torch.ones(4, dtype=torch.bool), 0, 3)
    t2.load_state_dict(t.state_dict())
    buyer2.load_state_dict(buyer.state_dict())
    assert torch.equal(t2.bought, t.bought) and buyer2.calibration == buyer.calibration
    assert buyer2.votes == buyer.votes
    close_epoch(t, [0.5] * 4)
    close_epoch(t2, [0.5] * 4)
    second, second2 = buyer.buy(t), buyer2.buy(t2)
    assert second == second2 and second["question"] != first["question"]
    # a checkpoint from before labels.*: nothing bought
    old = t.state_dict()
    del old["bought"]
    t3 = tracker(labeled)
    t3.load_state_dict(old)
    assert not t3.bought.any()
    buyer2.load_state_dict(None)  # and a buyer keeps what it has


def test_a_bought_question_leaves_the_selection_and_cannot_be_bought_again():
    t = tracker([True, False, False, False])
    close_epoch(t, [0.5] * 4)
    t.add_labels(torch.tensor([2]))
    close_epoch(t, [0.5] * 4)
    assert not t.selected[2] and t.gate(torch.tensor([2])).item() == 1.0
    assert t.selection_row()["bought"] == [False, True, False]
    with pytest.raises(ValueError, match="bought before"):
        t.add_labels(torch.tensor([2]))
