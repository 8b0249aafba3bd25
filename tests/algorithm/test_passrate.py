import math

import pytest
import torch

from trapo.algorithm.passrate import (
    PassRateTracker,
    SelectionConfig,
    pass_rates,
    reliable_mask,
    similarity_scores,
    tcs,
    zscore,
)


def test_tcs_hand_values_and_zero_vectors():
    traj = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 2.0], [0.3, 0.7]])
    ref = torch.tensor([1.0, 1.0])
    expected = [1 / math.sqrt(2), 0.0, 1.0, (0.3 + 0.7) / (math.hypot(0.3, 0.7) * math.sqrt(2))]
    assert torch.allclose(tcs(traj, ref), torch.tensor(expected))
    assert torch.equal(tcs(traj, torch.zeros(2)), torch.zeros(4))  # zero reference: 0, not NaN
    assert tcs(torch.zeros(0, 5), torch.ones(5)).shape == (0,)
    with pytest.raises(ValueError, match="reference"):
        tcs(traj, torch.ones(3))


def test_reliable_mask_top_p_or_threshold():
    scores = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.2])
    # k = max(1, floor(0.2 * 5)) = 1 -> index 3; threshold 0.3 -> indices 1, 2, 3 (0.3 >= 0.3).
    assert reliable_mask(scores, 0.2, 0.3).tolist() == [False, True, True, True, False]
    assert reliable_mask(scores, 0.2, 0.31).tolist() == [False, True, False, True, False]
    # k = floor(0.4 * 5) = 2 -> indices 3, 1; nothing reaches the threshold.
    assert reliable_mask(scores, 0.4, 2.0).tolist() == [False, True, False, True, False]
    # top_p = 0 still keeps one (k = max(1, 0)).
    assert reliable_mask(scores, 0.0, 2.0).tolist() == [False, False, False, True, False]


def test_reliable_mask_ties_and_edges():
    # Ties at the cut go to the lower index, deterministically.
    assert reliable_mask(torch.tensor([0.5, 0.5, 0.5]), 0.34, 1.0).tolist() == [True, False, False]
    assert reliable_mask(torch.zeros(0), 0.1, 0.4).tolist() == []
    # floor(0.29 * 100) is 29, not the 28 that float rounding would give.
    assert int(reliable_mask(torch.arange(100.0), 0.29, 1e9).sum()) == 29
    with pytest.raises(ValueError, match="top_p"):
        reliable_mask(torch.ones(3), 1.5, 0.4)


def test_pass_rates():
    correct = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert pass_rates(correct).tolist() == [0.75, 0.0]


def _brute_cosines(x, db):
    def cos(a, b):
        na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
        return 0.0 if na == 0 or nb == 0 else sum(p * q for p, q in zip(a, b)) / (na * nb)

    return [[cos(a, b) for b in db] for a in x]


def _brute_zscore(row):
    mean = sum(row) / len(row)
    std = math.sqrt(sum((v - mean) ** 2 for v in row) / len(row))
    return [0.0] * len(row) if std == 0 else [(v - mean) / std for v in row]


@pytest.mark.parametrize("standardize", [False, True])
def test_similarity_variants_match_brute_force(standardize):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(7, 5, generator=g)
    x[0] = 0.0  # never solved
    x[1] = 0.5  # constant: zero after z-scoring
    db = torch.rand(4, 5, generator=g)
    xs = [_brute_zscore(r) for r in x.tolist()] if standardize else x.tolist()
    ds = [_brute_zscore(r) for r in db.tolist()] if standardize else db.tolist()
    cos = _brute_cosines(xs, ds)
    mean_row = [sum(col) / len(ds) for col in zip(*ds)]
    expect = {
        "mean_trajectory": [c[0] for c in _brute_cosines(xs, [mean_row])],
        "mean_cosine": [sum(r) / len(r) for r in cos],
        "max_cosine": [max(r) for r in cos],
    }
    for reference, values in expect.items():
        got = similarity_scores(x, db, reference=reference, standardize=standardize, chunk_elems=8)
        assert torch.allclose(got, torch.tensor(values), atol=1e-5), reference


def test_zscore_and_empty_database():
    z = zscore(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
    assert torch.allclose(z, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(similarity_scores(torch.ones(3, 2), torch.zeros(0, 2)), torch.zeros(3))


def _tracker(**kw):
    cfg = SelectionConfig(**{"warmup_epochs": 2, "top_p": 0.5, "threshold": 0.99, **kw})
    return PassRateTracker(torch.tensor([True, True, False, False]), cfg)


def _run_two_epochs(tr):
    idx = torch.arange(4)
    tr.record(idx, torch.tensor([0.2, 0.4, 0.9, 0.1]))
    first = tr.end_epoch()
    tr.record(idx, torch.tensor([0.6, 0.8, 0.9, 0.35]), pseudo_correct=torch.tensor([float("nan")] * 2 + [0.0, 1.0]))
    return first, tr.end_epoch()


def test_tracker_warmup_selection_database_and_diagnostics():
    tr = _tracker()
    first, second = _run_two_epochs(tr)
    # Epoch 1 is warm-up: nothing selected, unlabeled gated out.
    assert first["selected"] == 0 and first["tcs_selected"] is None
    assert tr.trajectories.shape == (4, 2)
    # Reference = mean of the labeled trajectories [.2,.6] and [.4,.8] = [.3, .7].
    ref_norm = math.hypot(0.3, 0.7)
    tcs_q2 = (0.9 * 0.3 + 0.9 * 0.7) / (math.hypot(0.9, 0.9) * ref_norm)  # 0.928
    tcs_q3 = (0.1 * 0.3 + 0.35 * 0.7) / (math.hypot(0.1, 0.35) * ref_norm)  # 0.992
    assert tr.scores[2].item() == pytest.approx(tcs_q2, abs=1e-6)
    assert tr.scores[3].item() == pytest.approx(tcs_q3, abs=1e-6)
    # top-p keeps k = max(1, floor(.5 * 2)) = 1: q3. Threshold .99 also admits q3 only.
    assert tr.gate(torch.arange(4)).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert second["selected"] == 1 and second["database"] == 3
    assert second["tcs_selected"] == pytest.approx(tcs_q3, abs=1e-6)
    assert second["tcs_rejected"] == pytest.approx(tcs_q2, abs=1e-6)
    assert second["precision_selected"] == 1.0 and second["precision_rejected"] == 0.0
    # The selected question now belongs to the reliable database and shapes the reference.
    assert torch.allclose(tr.mean_reference(), torch.tensor([(0.2 + 0.4 + 0.1) / 3, (0.6 + 0.8 + 0.35) / 3]))


def test_tracker_gates_unlabeled_during_warmup():
    tr = _tracker(warmup_epochs=3)
    _run_two_epochs(tr)
    assert tr.gate(torch.arange(4)).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_tracker_fills_unrecorded_questions_with_last_rate():
    tr = _tracker()
    _run_two_epochs(tr)
    tr.record(torch.tensor([0, 2]), torch.tensor([1.0, 0.5]))
    report = tr.end_epoch()
    assert report["unrecorded"] == 2
    assert torch.allclose(tr.trajectories[:, 2], torch.tensor([1.0, 0.8, 0.5, 0.35]))


def test_tracker_state_dict_round_trip_continues_identically():
    a = _tracker()
    _run_two_epochs(a)
    a.record(torch.tensor([1]), torch.tensor([0.25]))  # mid-epoch state must survive too
    b = _tracker()
    b.load_state_dict(a.state_dict())
    for tr in (a, b):
        tr.record(torch.tensor([0, 2, 3]), torch.tensor([0.7, 0.1, 0.6]))
    ra, rb = a.end_epoch(), b.end_epoch()
    assert ra == rb
    assert torch.equal(a.trajectories, b.trajectories)
    assert torch.equal(a.selected, b.selected) and torch.equal(a.in_database, b.in_database)


def test_tracker_rejects_foreign_checkpoint_and_bad_records():
    a = _tracker()
    other = PassRateTracker(torch.tensor([True, False, False, False]))
    with pytest.raises(ValueError, match="labeled set"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(IndexError):
        a.record(torch.tensor([4]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        a.record(torch.tensor([0]), torch.tensor([1.5]))
    with pytest.raises(ValueError, match="reference"):
        SelectionConfig(reference="median")


def test_tracker_public_code_variant_runs_through_config():
    tr = _tracker(reference="mean_cosine", standardize=True, top_p=0.0, threshold=2.0)
    _run_two_epochs(tr)
    # z-scored 2-point trajectories are +-1 patterns: q2 is constant -> 0; q3 rises like the labeled ones -> 1.
    assert tr.scores[2].item() == 0.0 and tr.scores[3].item() == pytest.approx(1.0)
    assert tr.selected.tolist() == [False, False, False, True]


def test_random_control_selects_as_many_but_at_random():
    """The paper's random_select control: same count as the rule, chosen uniformly (seeded)."""
    labeled = torch.tensor([True] * 4 + [False] * 40)

    def run(random, seed=0):
        strategy = "random" if random else "tcs"
        tr = PassRateTracker(
            labeled, SelectionConfig(warmup_epochs=1, top_p=0.1, threshold=0.9, strategy=strategy, random_seed=seed)
        )
        rates = torch.linspace(0, 1, 44)
        tr.record(torch.arange(44), rates, torch.ones(44))
        tr.end_epoch()
        tr.record(torch.arange(44), rates.flip(0), torch.ones(44))
        tr.end_epoch()
        return tr.selected.clone(), tr.last_correct.clone()

    rule, correct = run(False)
    rand_a, _ = run(True, seed=1)
    rand_b, _ = run(True, seed=1)
    rand_c, _ = run(True, seed=2)
    assert int(rand_a.sum()) == int(rule.sum()) >= 4  # top 10% of 40 at least
    assert torch.equal(rand_a, rand_b) and not torch.equal(rand_a, rand_c)
    assert not rand_a[:4].any()  # labeled questions are never "selected"
    assert torch.equal(correct, torch.ones(44))  # the closed epoch's pseudo-label correctness is kept
