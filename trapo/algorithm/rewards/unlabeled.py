"""The reward of an unlabeled question's responses: `reward.unlabeled`, built once, called per question.

From the vote (`Vote`: each response's cluster of equal answers, so a task verifier's `key` and `equal`
define them):
- majority (TTRL): 1 in the majority cluster, else 0 (paper eq. "unsupervised-method").
- cluster_share (EMPO, arXiv 2504.05812): the share of the G responses in the response's cluster,
  p(c | q), whose expectation is minus the semantic entropy the method minimises; 0 without an answer.
- scrl (SCRL, arXiv 2603.19880, its binary reward): a positive pseudo-label only where the consensus is
  strong (`scrl_rewards`), negative pseudo-labels on rare answers the policy is unsure of.
From the policy's own token distributions (Table 1's baselines, `confidence.py`): self_certainty,
token_entropy, sentence_entropy, the score itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trapo.algorithm.rewards.verifiable import Vote
from trapo.config import ScrlConfig

CONFIDENCE_REWARDS = ("self_certainty", "token_entropy", "sentence_entropy")


def scrl_rewards(vote: Vote, entropy: Sequence[float], thresholds: ScrlConfig) -> list[float]:
    """SCRL's binary reward for one question's G responses: +1 in the positive cluster, -1 in a negative
    cluster or without an answer, 0 otherwise.

    entropy: [G] each response's mean token entropy. The positive cluster is the largest, if its share is
    at least `positive` and beats the second largest by more than `margin` (a tie never qualifies). A
    negative cluster is any other whose share is below `rare` and whose responses' mean entropy is at least
    the mean over all G responses: a rare answer the policy was not sure of (as SCRL's code does,
    Jasper-Yan/SCRL `determine_pseudo_labels`). A response without an answer scores -1 there too.
    """
    g = len(vote.cluster)
    if len(entropy) != g:
        raise ValueError(f"scrl_rewards: {len(entropy)} entropies for {g} responses")
    sizes = vote.sizes()
    ranked = sorted(range(len(sizes)), key=lambda c: -sizes[c])  # stable: ties keep the vote's order
    positive = None
    if ranked:
        top = sizes[ranked[0]] / g
        second = sizes[ranked[1]] / g if len(ranked) > 1 else 0.0
        if top >= thresholds.positive and (len(ranked) == 1 or top - second > thresholds.margin):
            positive = ranked[0]
    mean_all = sum(entropy) / g
    members: dict[int, list[float]] = {}
    for c, h in zip(vote.cluster, entropy):
        if c is not None:
            members.setdefault(c, []).append(h)
    negative = {
        c
        for c, hs in members.items()
        if c != positive and sizes[c] / g < thresholds.rare and sum(hs) / len(hs) >= mean_all
    }
    return [-1.0 if c is None or c in negative else 1.0 if c == positive else 0.0 for c in vote.cluster]


@dataclass(frozen=True)
class UnlabeledReward:
    """`reward.unlabeled` (`kind`) with its settings: what an unlabeled question's responses score."""

    kind: str = "majority"
    scrl: ScrlConfig = field(default_factory=ScrlConfig)

    @property
    def score_kind(self) -> str | None:
        """The policy's confidence score the reward reads (one forward over the responses), or None."""
        if self.kind == "scrl":
            return "token_entropy"  # minus the mean token entropy: SCRL's entropy gate
        return self.kind if self.kind in CONFIDENCE_REWARDS else None

    def __call__(self, vote: Vote, scores: Sequence[float] | None = None) -> list[float]:
        """[G] rewards from the question's vote and, for the kinds that read one, its [G] `score_kind` scores."""
        if self.kind == "majority":
            return [1.0 if a else 0.0 for a in vote.agree]
        if self.kind == "cluster_share":
            return list(vote.share)
        if scores is None:
            raise ValueError(f"reward.unlabeled={self.kind} needs the policy's {self.score_kind} scores")
        if self.kind == "scrl":
            return scrl_rewards(vote, [-s for s in scores], self.scrl)
        if self.kind in CONFIDENCE_REWARDS:
            return list(scores)
        raise ValueError(f"UnlabeledReward: unknown kind {self.kind!r}")
