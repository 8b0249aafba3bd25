"""Selection strategies (paper section "Different Selection Strategies"): TCS, random, sentence-level
entropy and self-certainty, by the paper's rule or at a fixed ratio; hand-built trajectories and scores."""

import json
import math

import pytest
import torch

from trapo.algorithm.logits import TokenStats
from trapo.algorithm.passrate import PassRateTracker, SelectionConfig
from trapo.algorithm.rewards.confidence import confidence_reward, self_certainty_reward
from trapo.algorithm.selection import confidence_kind, fixed_count, random_mask, select, top_k_mask

# Two labeled questions (0, 1) and six unlabeled (2..7); trajectories over two epochs.
LABELED = torch.tensor([True, True] + [False] * 6)
EPOCH1 = torch.tensor([0.2, 0.4, 0.3, 0.9, 0.5, 0.0, 1.0, 0.0])
EPOCH2 = torch.tensor([0.8, 1.0, 0.9, 0.3, 0.5, 0.0, 0.0, 1.0])
# The reference (mean of the labeled trajectories) is [0.3, 0.9], |ref| = sqrt(0.9); TCS by hand:
TCS = {
    2: 1.0,  # [0.3, 0.9]: the reference itself
    3: 0.54 / 0.9,  # [0.9, 0.3]: (0.27 + 0.27) / (sqrt(0.9) sqrt(0.9))
    4: 0.6 / (math.sqrt(0.5) * math.sqrt(0.9)),  # [0.5, 0.5]: 0.894
    5: 0.0,  # never solved
    6: 0.3 / math.sqrt(0.9),  # [1, 0]: 0.316
    7: 0.9 / math.sqrt(0.9),  # [0, 1]: 0.949
}
# Rule (top_p 0.2, Gamma 0.9): k = max(1, floor(0.2 * 6)) = 1 -> {2}; TCS >= 0.9 -> {2, 7}.
RULE = {2, 7}
# Epoch 2's mean confidence of each unlabeled question's G = 4 responses (epoch 1's are reversed,
# so that a selection by the wrong epoch's scores would show).
CONF = {
    "entropy": [-50.0, -5.0, -20.0, -1.0, -30.0, -80.0],  # sequence log-likelihoods: higher = lower entropy
    "self_certainty": [0.1, 0.9, 0.5, 0.2, 0.7, 0.3],
}
CORRECT = torch.tensor([math.nan, math.nan, 1, 0, 1, 0, 1, 1])  # pseudo-label == hidden gold


def responses(means):
    """[U, 4] per-response scores around each mean (the mean over G is what ranks a question)."""
    means = torch.tensor(means)
    return means[:, None] + torch.tensor([-1.5, 0.5, -0.5, 1.5])


def run_tracker(strategy, fixed_ratio=None, *, seed=0, record_confidence=True):
    cfg = SelectionConfig(
        warmup_epochs=2, top_p=0.2, threshold=0.9, strategy=strategy, fixed_ratio=fixed_ratio, random_seed=seed
    )
    tr = PassRateTracker(LABELED, cfg)
    conf2 = CONF.get(strategy, CONF["entropy"])
    conf1 = list(reversed(conf2))
    for rates, conf in ((EPOCH1, conf1), (EPOCH2, conf2)):
        scores = torch.cat([torch.full((2,), math.nan), responses(conf).mean(dim=1)])  # labeled: unscored
        tr.record(torch.arange(8), rates, CORRECT, scores if record_confidence else None)
        out = tr.end_epoch()
    return tr, out


def chosen(tr):
    return set(tr.selected.nonzero().squeeze(1).tolist())


def test_tcs_by_hand():
    tr, _ = run_tracker("tcs")
    assert torch.allclose(tr.scores[2:], torch.tensor([TCS[q] for q in range(2, 8)]), atol=1e-6)


@pytest.mark.parametrize(
    "strategy, fixed_ratio, expected",
    [
        ("tcs", None, RULE),  # the paper's rule, today's default
        ("tcs", 0.5, {2, 7, 4}),  # floor(0.5 * 6) = 3 highest TCS; the threshold plays no part
        ("entropy", None, {5, 3}),  # as many as the rule (2), the highest log-likelihoods -1, -5
        ("entropy", 0.5, {5, 3, 4}),  # -1, -5, -20
        ("self_certainty", None, {3, 6}),  # 0.9, 0.7
        ("self_certainty", 0.5, {3, 6, 4}),  # 0.9, 0.7, 0.5
        ("tcs", 0.0, set()),
        ("entropy", 1.0, {2, 3, 4, 5, 6, 7}),
    ],
)
def test_each_strategy_selects_what_its_definition_says(strategy, fixed_ratio, expected):
    tr, out = run_tracker(strategy, fixed_ratio)
    assert chosen(tr) == expected
    assert out["strategy"] == strategy and out["selected"] == len(expected)
    assert tr.in_database.tolist() == [True, True] + [q in expected for q in range(2, 8)]
    assert tr.gate(torch.arange(8)).tolist() == [1.0, 1.0] + [float(q in expected) for q in range(2, 8)]


@pytest.mark.parametrize("fixed_ratio", [None, 0.5])
def test_random_strategy_is_todays_seeded_draw(fixed_ratio):
    """As many as the rule (or floor(r * U)), drawn by randperm seeded with seed * 100003 + epoch: the
    generator stream of the selection.random control this strategy replaces."""
    k = len(RULE) if fixed_ratio is None else 3
    for seed in (0, 1, 2):
        tr, out = run_tracker("random", fixed_ratio, seed=seed)
        gen = torch.Generator().manual_seed(seed * 100_003 + 2)
        assert chosen(tr) == {2 + i for i in torch.randperm(6, generator=gen)[:k].tolist()}
        assert out["score_selected"] is None and out["tcs_selected"] is not None  # random ranks nothing
    assert chosen(run_tracker("random", seed=1)[0]) != chosen(run_tracker("random", seed=2)[0])


def test_diagnostics_carry_the_strategy_score():
    tr, out = run_tracker("entropy")  # selected {3, 5}: scores -5, -1; TCS 0.6, 0
    assert out["score_selected"] == pytest.approx(-3.0)
    assert out["score_rejected"] == pytest.approx((-50 - 20 - 30 - 80) / 4)
    assert out["tcs_selected"] == pytest.approx((TCS[3] + TCS[5]) / 2)  # `tcs` keeps meaning TCS
    assert out["tcs_rejected"] == pytest.approx((TCS[2] + TCS[4] + TCS[6] + TCS[7]) / 4)
    assert out["precision_selected"] == 0.0 and out["precision_rejected"] == 1.0
    assert out["unscored"] == 0
    row = tr.selection_row()
    assert row["strategy"] == "entropy" and row["question"] == [2, 3, 4, 5, 6, 7]
    assert row["score"] == pytest.approx(CONF["entropy"])
    assert row["tcs"] == pytest.approx([TCS[q] for q in range(2, 8)], abs=1e-5)
    assert row["selected"] == [False, True, False, True, False, False]
    assert json.loads(json.dumps(row)) == row  # plain JSON: no NaN
    _, tcs_out = run_tracker("tcs")
    assert tcs_out["score_selected"] == tcs_out["tcs_selected"] and tcs_out["unscored"] is None


def test_confidence_direction_follows_the_paper():
    """Lower sentence entropy and higher self-certainty are the more reliable: built with the reward functions."""
    mask = torch.ones(2 * 3, 5, dtype=torch.bool)  # 2 unlabeled questions x G = 3 responses x 5 tokens
    logprobs = torch.cat([torch.full((3, 5), -0.05), torch.full((3, 5), -2.0)])  # q1 sure, q2 unsure
    peaked = torch.zeros(3, 5, 7)
    peaked[..., 0] = 6.0
    logits = torch.cat([torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)) * 0.1, peaked])  # q2 sure
    per_kind = {
        "entropy": confidence_reward("sentence_entropy", TokenStats(logprobs, None, None), mask),
        "self_certainty": self_certainty_reward(logits, mask),
    }
    for strategy, expected in (("entropy", [False, True, False]), ("self_certainty", [False, False, True])):
        assert confidence_kind(strategy) in ("sentence_entropy", "self_certainty")
        tr = PassRateTracker(
            torch.tensor([True, False, False]),
            SelectionConfig(warmup_epochs=1, strategy=strategy, fixed_ratio=0.5),
        )
        means = per_kind[strategy].view(2, 3).mean(dim=1)  # [2]: each question's mean over its G responses
        tr.record(
            torch.arange(3), torch.tensor([0.5, 0.5, 0.5]), confidence=torch.cat([torch.tensor([math.nan]), means])
        )
        tr.end_epoch()
        assert tr.selected.tolist() == expected, strategy


def test_unscored_questions_carry_over_or_rank_last():
    cfg = SelectionConfig(warmup_epochs=2, strategy="self_certainty", fixed_ratio=0.5)
    tr = PassRateTracker(torch.tensor([True, False, False, False, False]), cfg)
    nan = math.nan
    tr.record(torch.arange(5), torch.full((5,), 0.5), confidence=torch.tensor([nan, 0.9, 0.1, nan, 0.2]))
    tr.end_epoch()  # warm-up
    # epoch 2: question 1 is not recorded (keeps 0.9), question 3 is recorded but never scored
    tr.record(torch.tensor([0, 2, 3, 4]), torch.full((4,), 0.5), confidence=torch.tensor([nan, 0.3, nan, 0.4]))
    out = tr.end_epoch()
    assert tr.selected.tolist() == [False, True, False, False, True]  # 0.9 (carried over), 0.4
    assert out["unrecorded"] == 1 and out["unscored"] == 1
    assert tr.selection_row()["score"] == [0.9, 0.3, None, 0.4]
    expect = torch.tensor([[nan, nan], [0.9, 0.9], [0.1, 0.3], [nan, nan], [0.2, 0.4]])
    assert torch.allclose(tr.confidence, expect, equal_nan=True)  # [Q, t] per-epoch history


def test_warmup_is_unchanged_by_the_strategy():
    runs = {}
    for strategy in ("tcs", "random", "entropy", "self_certainty"):
        tr = PassRateTracker(LABELED, SelectionConfig(warmup_epochs=2, strategy=strategy, fixed_ratio=0.5))
        tr.record(torch.arange(8), EPOCH1, CORRECT, torch.arange(8.0))
        runs[strategy] = (tr, tr.end_epoch())
    for tr, out in runs.values():
        assert out["selected"] == 0 and out["tcs_selected"] is None and out["score_selected"] is None
        assert torch.equal(tr.in_database, LABELED) and not tr.selected.any()
        assert torch.equal(tr.trajectories, runs["tcs"][0].trajectories)
        assert tr.gate(torch.arange(8)).tolist() == LABELED.float().tolist()


def test_fixed_ratio_counts():
    assert [fixed_count(r, 10) for r in (0.0, 0.1, 0.3, 0.35, 1.0)] == [0, 1, 3, 3, 10]
    assert fixed_count(0.29, 100) == 29 and fixed_count(0.3, 3000) == 900  # the paper's 3K unlabeled at 30%
    labeled = torch.tensor([True] * 3 + [False] * 37)
    g = torch.Generator().manual_seed(0)
    rates = torch.rand(2, 40, generator=g)
    for strategy in ("tcs", "random", "entropy", "self_certainty"):
        for ratio, count in ((0.1, 3), (0.3, 11), (0.5, 18)):
            tr = PassRateTracker(labeled, SelectionConfig(warmup_epochs=1, strategy=strategy, fixed_ratio=ratio))
            tr.record(torch.arange(40), rates[0], confidence=torch.rand(40, generator=g))
            assert tr.end_epoch()["selected"] == count == math.floor(ratio * 37)
            # the database grew by the first selection; the second selects floor(r * U) again among all U
            tr.record(torch.arange(40), rates[1], confidence=torch.rand(40, generator=g))
            assert tr.end_epoch()["selected"] == count and not tr.selected[:3].any()


def test_top_k_ties_nan_and_select_errors():
    assert top_k_mask(torch.tensor([0.5, 0.5, 0.5]), 2).tolist() == [True, True, False]  # ties: lower index
    assert top_k_mask(torch.tensor([math.nan, -1e9, math.nan]), 1).tolist() == [False, True, False]
    assert top_k_mask(torch.tensor([1.0, 2.0]), 5).tolist() == [True, True]
    assert top_k_mask(torch.zeros(0), 1).tolist() == []
    assert random_mask(5, 0, 0).tolist() == [False] * 5
    with pytest.raises(ValueError, match="needs confidence scores"):
        select("entropy", torch.zeros(3), None, torch.zeros(3, dtype=torch.bool), fixed_ratio=0.3, seed=0)
    with pytest.raises(ValueError, match="strategy"):
        confidence_kind("perplexity")
    with pytest.raises(ValueError, match="confidence must be"):
        PassRateTracker(LABELED).record(torch.arange(2), torch.zeros(2), confidence=torch.zeros(3))


def _equal(a, b):
    return torch.allclose(a, b, equal_nan=True) and a.shape == b.shape


def test_state_round_trip_mid_epoch():
    a, _ = run_tracker("entropy", 0.34)  # two epochs closed, the first selection made: floor(0.34 * 6) = 2
    a.record(torch.arange(4), EPOCH2[:4], CORRECT[:4], torch.tensor([math.nan, math.nan, -3.0, -4.0]))  # mid-epoch
    b = PassRateTracker(LABELED, a.config)
    b.load_state_dict(a.state_dict())
    for tr in (a, b):
        tr.record(torch.arange(4, 8), EPOCH2[4:], CORRECT[4:], torch.tensor([-9.0, -2.0, -7.0, -8.0]))
    ra, rb = a.end_epoch(), b.end_epoch()
    assert ra == rb and a.selection_row() == b.selection_row()
    assert _equal(a.confidence, b.confidence) and _equal(a.ranking, b.ranking) and torch.equal(a.selected, b.selected)
    assert chosen(a) == {5, 2}  # -2, -3: the mid-epoch scores saved before the restore count


@pytest.mark.toy_run
def test_toy_run_logs_entropy_selection(toy_dir, tmp_path):
    """One toy run: warm-up epoch of 2 steps, then the entropy strategy selects 25% of the 48 unlabeled."""
    from toyrun import metrics, overrides, train

    kv = {
        "mode": "trapo",
        "max_steps": 3,
        "run_name": "entropy",
        "train.rollout_batch_size": 32,  # 64 questions: an epoch is 2 steps
        "train.update_batch_size": 32,
        "selection.strategy": "entropy",
        "selection.fixed_ratio": 0.25,
    }
    train(overrides(toy_dir, tmp_path, **kv))
    m = metrics(tmp_path / "entropy")
    sel = m[1]["selection"]
    assert sel["strategy"] == "entropy" and sel["selected"] == 12 and sel["unscored"] == 0
    assert sel["score_selected"] > sel["score_rejected"]
    (row,) = [json.loads(x) for x in (tmp_path / "entropy" / "selection.jsonl").read_text().splitlines()]
    assert row["strategy"] == "entropy" and len(row["score"]) == len(row["tcs"]) == 48
    assert all(s is not None and s <= 0 for s in row["score"])  # sequence log-likelihoods
    picked = [s for s, on in zip(row["score"], row["selected"]) if on]
    assert len(picked) == 12 and min(picked) >= max(s for s, on in zip(row["score"], row["selected"]) if not on)
    assert m[2]["trained_sequences"] == (m[2]["labeled_questions"] + m[2]["unlabeled_in_loss"]) * 8
    assert all(r["unlabeled_in_loss"] == 0 for r in m[:2])
    print(
        "toy entropy run:",
        {
            k: sel[k]
            for k in (
                "score_selected",
                "score_rejected",
                "tcs_selected",
                "tcs_rejected",
                "precision_selected",
                "precision_rejected",
            )
        },
        "step-3 unlabeled_in_loss",
        m[2]["unlabeled_in_loss"],
    )


def test_tensorboard_scalars_carry_the_strategy_score():
    from trapo.training.tensorboard_writer import selection_scalars

    tr, out = run_tracker("entropy")
    values = selection_scalars(tr.selection_row())
    assert values["score_selected"] == pytest.approx(out["score_selected"])
    assert values["score_rejected"] == pytest.approx(out["score_rejected"])
    assert values["tcs_selected"] == pytest.approx(out["tcs_selected"], abs=1e-5)
    random_row = run_tracker("random")[0].selection_row()
    assert random_row["score"] == [None] * 6 and "score_selected" not in selection_scalars(random_row)
