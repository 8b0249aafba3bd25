"""reward.unlabeled: SCRL's binary reward (selective positive label, entropy-gated negatives) by hand, and the
`UnlabeledReward` every kind goes through, from the vote's clusters (Math-Verify's equivalence)."""

import pytest

from trapo.algorithm.rewards import Vote
from trapo.algorithm.rewards.unlabeled import UnlabeledReward, scrl_rewards
from trapo.config import ScrlConfig
from trapo.data import Question
from trapo.training.grading import grade

SCRL = ScrlConfig()  # tau_pos 0.5, tau_marg 0.15, tau_low 0.15 (SCRL's code defaults)


def vote(cluster: list[int | None], label_cluster: int | None) -> Vote:
    """A hand-made vote: each response's cluster; the label is its cluster's name."""
    g = len(cluster)
    sizes = {c: cluster.count(c) for c in set(cluster) if c is not None}
    share = [0.0 if c is None else sizes[c] / g for c in cluster]
    agree = [c is not None and c == label_cluster for c in cluster]
    return Vote(None if label_cluster is None else f"c{label_cluster}", agree, share, cluster)


def test_a_strong_majority_is_positive_and_rare_unsure_answers_negative():
    """8 answers: cluster 0 x5, cluster 1 x1, cluster 2 x1, one without an answer. Mean entropy over the 8:
    (5 x 0.2 + 0.5 + 1.0 + 0.3) / 8 = 0.35. Cluster 0: share 5/8 >= 0.5, beats 1/8 by 0.5 > 0.15: positive.
    Clusters 1 and 2: share 1/8 < 0.15 and entropy 0.5, 1.0 >= 0.35: negative. No answer: -1."""
    v = vote([0, 0, 0, 0, 0, 1, 2, None], 0)
    h = [0.2] * 5 + [0.5, 1.0, 0.3]
    assert scrl_rewards(v, h, SCRL) == [1.0] * 5 + [-1.0, -1.0, -1.0]
    # cluster 1 now surer than the group: (1.0 + 0.3 + 1.0 + 0.3) / 8 = 0.325 > 0.3, so it is left at 0
    h = [0.2] * 5 + [0.3, 1.0, 0.3]
    assert scrl_rewards(v, h, SCRL) == [1.0] * 5 + [0.0, -1.0, -1.0]


def test_a_weak_consensus_gives_no_positive_label():
    """4 / 3 / 1 of 8: the top share 0.5 reaches tau_pos but beats 3/8 by 0.125, not more than 0.15: no positive
    label, and the clusters of 4 and 3 score 0 (the 1/8 one is negative: entropy 0.9 >= the mean)."""
    v = vote([0, 0, 0, 0, 1, 1, 1, 2], 0)
    h = [0.1] * 7 + [0.9]
    assert scrl_rewards(v, h, SCRL) == [0.0] * 7 + [-1.0]
    # 3 of 8 is below tau_pos whatever the margin: no positive; 2 of 8 = 0.25 is not rare
    v = vote([0, 0, 0, 1, 1, 2, 2, None], 0)
    assert scrl_rewards(v, [0.5] * 8, SCRL) == [0.0] * 7 + [-1.0]
    # a tie for the largest cluster never qualifies; one answer throughout does, whatever its share above 0.5
    assert scrl_rewards(vote([0, 0, 1, 1], None), [0.1] * 4, SCRL) == [0.0] * 4
    assert scrl_rewards(vote([0, 0, 0, None], 0), [0.1] * 4, SCRL) == [1.0, 1.0, 1.0, -1.0]
    with pytest.raises(ValueError, match="3 entropies for 4 responses"):
        scrl_rewards(vote([0, 0, 0, None], 0), [0.1] * 3, SCRL)


def test_each_kind_reads_what_it_names():
    v = vote([0, 0, 1, None], 0)
    assert UnlabeledReward("majority")(v) == [1.0, 1.0, 0.0, 0.0]
    assert UnlabeledReward("cluster_share")(v) == [0.5, 0.5, 0.25, 0.0]
    assert UnlabeledReward("self_certainty")(v, [0.1, 0.2, 0.3, 0.4]) == [0.1, 0.2, 0.3, 0.4]
    # scrl reads token_entropy's score, minus the mean entropy. 2 of 4 beat 1 of 4 by 0.25: positive; the
    # cluster of 1 (share 0.25) is not rare, however unsure
    assert UnlabeledReward("scrl").score_kind == "token_entropy"
    assert UnlabeledReward("scrl")(v, [-0.1, -0.1, -0.9, -0.1]) == [1.0, 1.0, 0.0, -1.0]
    assert UnlabeledReward("majority").score_kind is None and UnlabeledReward("sentence_entropy").score_kind
    with pytest.raises(ValueError, match="needs the policy's token_entropy scores"):
        UnlabeledReward("scrl")(v)


def test_scrl_through_grading_clusters_equivalent_spellings():
    """Through `grade` and Math-Verify: 1/2, 0.5 and \\frac{1}{2} are one cluster of 5 of 8 (positive), 3 is a
    rare cluster the policy was unsure of (negative), 7 a rare one it was sure of (0)."""
    texts = [
        ["\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", "\\boxed{0.5}"]
        + ["\\boxed{3}", "\\boxed{7}", "no answer"]
    ]
    entropy = [0.2] * 5 + [0.8, 0.1, 0.4]  # mean 0.3125
    question = Question("q", "?", "1/2", False, None, "row 1")
    g = grade([question], texts, timeout=5.0, unlabeled=UnlabeledReward("scrl"), scores={0: [-h for h in entropy]})
    assert g.rewards == [[1.0] * 5 + [-1.0, 0.0, -1.0]]
    assert g.pass_rates == [5 / 8] and g.pseudo_correct == [1.0]  # the vote's pass rate, as for every kind
