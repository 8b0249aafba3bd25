"""The curriculum's rule (trapo/algorithm/curriculum.py): saturation over recorded pass rates, the skip and
re-admission pattern, the forgotten count, and TCS on a tracker whose skipped questions' entries were carried."""

import pytest
import torch

from trapo.algorithm.curriculum import epochs_since_rolled_out, plan_epoch, readmission_outcome, saturation
from trapo.algorithm.passrate import PassRateTracker
from trapo.config import SelectionConfig

T, F = True, False


def test_saturation_reads_the_last_k_recorded_pass_rates_and_ignores_carried_ones():
    traj = torch.tensor(
        [
            [0.5, 1.0, 1.0, 1.0],  # last 3 recorded all 1
            [1.0, 1.0, 0.875, 1.0],  # a 0.875 among the last 3
            [0.0, 0.0, 0.0, 0.0],  # all 0
            [1.0, 1.0, 0.5, 0.5],  # recorded 1, 1, 0.5; the last 0.5 was carried
            [1.0, 1.0, 1.0, 1.0],  # only 2 recorded
            [0.25, 0.0, 0.0, 0.0],  # 0.25 is the 4th-last recorded: outside the window
        ]
    )
    observed = torch.tensor([[T, T, T, T], [T, T, T, T], [T, T, T, T], [T, T, T, F], [F, T, F, T], [T, T, T, T]])
    solved, failed = saturation(traj, observed, window=3)
    assert solved.tolist() == [T, F, F, F, F, F]
    assert failed.tolist() == [F, F, T, F, F, T]
    solved1, failed1 = saturation(traj, observed, window=1)
    assert solved1.tolist() == [T, T, F, F, T, F] and failed1.tolist() == [F, F, T, F, F, T]


def test_epochs_since_rolled_out_counts_the_trailing_carried_entries():
    observed = torch.tensor([[T, T, T], [T, F, F], [F, F, F], [F, T, F]])
    assert epochs_since_rolled_out(observed).tolist() == [0, 2, 3, 1]
    assert epochs_since_rolled_out(torch.zeros(2, 0, dtype=torch.bool)).tolist() == [0, 0]


def test_only_labeled_questions_are_skipped_and_never_below_one_batch():
    traj = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.5]])
    observed = torch.ones(4, 2, dtype=torch.bool)
    labeled = torch.tensor([T, T, F, T])  # question 2 is unlabeled and unanimous: kept
    plan = plan_epoch(traj, observed, labeled, window=2, readmit_every=3)
    assert plan.skipped.tolist() == [T, T, F, F] and plan.readmitted.tolist() == [F, F, F, F]
    assert plan.solved.tolist() == [T, F, F, F] and plan.failed.tolist() == [F, T, F, F]
    # two questions left would not fill a batch of 3: nothing is skipped, the saturated ones count as re-admitted
    small = plan_epoch(traj, observed, labeled, window=2, readmit_every=3, min_admitted=3)
    assert small.skipped.tolist() == [F, F, F, F] and small.readmitted.tolist() == [T, T, F, F]
    with pytest.raises(ValueError, match="readmit_every must be >= 2"):
        plan_epoch(traj, observed, labeled, window=2, readmit_every=1)


def run_epochs(epochs, rate_of, window, every, labeled):
    """A tracker through `epochs` epochs where each admitted question records rate_of(question, epoch);
    returns the skipped set of each epoch (1-based epoch numbers) and the tracker."""
    tracker = PassRateTracker(labeled, SelectionConfig(warmup_epochs=100))
    skipped = []
    for epoch in range(1, epochs + 1):
        plan = plan_epoch(tracker.trajectories, tracker.observed, tracker.labeled, window, every)
        skipped.append(plan.skipped.nonzero().flatten().tolist())
        admitted = plan.admitted.nonzero().flatten()
        tracker.record(admitted, torch.tensor([rate_of(int(q), epoch) for q in admitted]))
        tracker.end_epoch()
    return skipped, tracker


def test_a_saturated_question_is_rolled_out_once_every_m_epochs_until_it_changes():
    """k = 3, m = 4: question 0 always solved: recorded at epochs 1-3, skipped 4-6, back at 7, skipped 8-10,
    back at 11. Question 1 solved until a re-admission finds it forgotten (0.5 at epoch 7): it stays in."""
    labeled = torch.tensor([T, T, T])

    def rate(q, epoch):
        if q == 1 and epoch >= 7:
            return 0.5
        return 1.0 if q < 2 else 0.25

    skipped, tracker = run_epochs(12, rate, window=3, every=4, labeled=labeled)
    assert [0 in s for s in skipped] == [F, F, F, T, T, T, F, T, T, T, F, T]
    assert [1 in s for s in skipped] == [F, F, F, T, T, T, F, F, F, F, F, F]
    assert all(2 not in s for s in skipped)
    # the skipped epochs are carried (the last recorded rate, marked not observed)
    assert tracker.observed[0].tolist() == [T, T, T, F, F, F, T, F, F, F, T, F]
    assert tracker.trajectories[0].tolist() == [1.0] * 12
    # epoch 7 re-admitted both; question 1 came back at 0.5: forgotten
    t7, o7 = tracker.trajectories[:, :7], tracker.observed[:, :7]
    outcome = readmission_outcome(t7, o7, labeled, window=3, readmit_every=4)
    assert outcome == {"readmitted_rolled_out": 2, "readmitted_forgotten": 1, "readmitted_unstuck": 0}
    assert readmission_outcome(t7[:, :6], o7[:, :6], labeled, window=3, readmit_every=4)["readmitted_rolled_out"] == 0


def test_a_failed_question_that_comes_back_solved_counts_as_unstuck():
    labeled = torch.tensor([T, T])
    skipped, tracker = run_epochs(4, lambda q, e: 0.0 if e < 4 else 0.125, window=2, every=2, labeled=labeled)
    assert skipped == [[], [], [0, 1], []]  # m = 2: skipped one epoch, re-admitted the next
    out = readmission_outcome(tracker.trajectories, tracker.observed, labeled, window=2, readmit_every=2)
    assert out == {"readmitted_rolled_out": 2, "readmitted_forgotten": 0, "readmitted_unstuck": 2}


def test_tcs_with_skipped_questions_equals_tcs_with_their_carried_values_recorded():
    """The rule for the reference: a skipped labeled question's entry is its last recorded pass rate. A tracker
    whose skipped questions were not recorded (carried, observed False) scores and selects exactly as one that
    recorded those values; the unlabeled questions' trajectories are observed throughout."""
    g = torch.Generator().manual_seed(0)
    q, labeled_n, epochs = 40, 16, 7
    labeled = torch.arange(q) < labeled_n
    base = torch.randint(0, 9, (q, epochs), generator=g).float() / 8
    base[:6] = 1.0  # six labeled questions always solved, two always failed: they saturate and get skipped
    base[6:8] = 0.0
    cfg = SelectionConfig(warmup_epochs=2, top_p=0.2, threshold=0.5, reference="mean_cosine", standardize=True)
    skipping, recording = PassRateTracker(labeled, cfg), PassRateTracker(labeled, cfg)
    skipped_any = False
    for epoch in range(epochs):
        plan = plan_epoch(skipping.trajectories, skipping.observed, labeled, window=2, readmit_every=3)
        skipped_any |= bool(plan.skipped.any())
        assert not plan.skipped[~labeled].any()
        admitted = plan.admitted.nonzero().flatten()
        skipping.record(admitted, base[admitted, epoch])
        carried = skipping.trajectories[:, -1] if epoch else torch.zeros(q)
        recording.record(torch.arange(q), torch.where(plan.skipped, carried, base[:, epoch]))
        a, b = skipping.end_epoch(), recording.end_epoch()
        assert torch.equal(skipping.trajectories, recording.trajectories)
        assert torch.equal(skipping.scores, recording.scores) and torch.equal(skipping.selected, recording.selected)
        assert {k: v for k, v in a.items() if k != "unrecorded"} == {k: v for k, v in b.items() if k != "unrecorded"}
    assert skipped_any
    assert skipping.observed[~labeled].all() and not skipping.observed[:8].all()
    assert recording.observed.all()


def test_the_tracker_saves_and_restores_the_observed_mask():
    tracker = PassRateTracker(torch.tensor([T, F, T]))
    tracker.record(torch.tensor([0, 1]), torch.tensor([1.0, 0.5]))
    tracker.end_epoch()
    state = tracker.state_dict()
    again = PassRateTracker(torch.tensor([T, F, T]))
    again.load_state_dict(state)
    assert again.observed.tolist() == [[T], [T], [F]]
    del state["observed"]  # a checkpoint from before the mask: every entry counts as recorded
    old = PassRateTracker(torch.tensor([T, F, T]))
    old.load_state_dict(state)
    assert old.observed.tolist() == [[T], [T], [T]]
