"""Gold labels bought during training (`labels.*`): which unlabeled questions, and how many, at an epoch end.

A run may buy up to `labels.budget` gold labels; the data already holds each unlabeled question's gold,
hidden from the reward, so buying one reveals it, and the question is labeled from then on (the pass-rate
tracker's `bought` mask: gate 1, gold rewards, no longer a candidate for selection). At each epoch end but
the run's last, `per_epoch` of the candidates (unlabeled, not bought, with a hidden gold) are bought, the
highest scores first; ties fall in an order drawn from the run's seed and the epoch. The scores:

- care (RLAVR/CARE, arXiv 2605.25864): the expected error of the group's GRPO advantages under its
  pseudo-label, E || A(pseudo rewards) - A(gold rewards) ||_2 (`advantage_gap`), the error the label
  would remove. CARE predicts the two unknowns, whether the vote is right and, if not, how many responses
  are right, with two probes trained offline on the policy's hidden states; here both are estimated from
  the run's own labeled groups, whose votes meet their gold (`Calibration`).
- tcs: the lowest trajectory cosine similarity to the reliable database's trajectories (TraPO's own score,
  the questions it trusts least).
- random: the tie order alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trapo.algorithm.passrate import PassRateTracker, similarity_scores
from trapo.algorithm.rewards import Vote
from trapo.config import LabelsConfig


def grpo_advantages(rewards: list[float]) -> list[float]:
    """(r - mean) / std over the group, population std; all zeros when the rewards are equal."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [0.0] * len(rewards) if std < 1e-8 else [(r - mean) / std for r in rewards]


def advantage_gap(g: int, x: int, y: int) -> float:
    """CARE's cost of a wrong pseudo-label: the L2 norm of the difference of a group's GRPO advantages when
    the x responses of the voted cluster score 1 (pseudo-label) and when y other responses score 1 (gold).
    g: responses; 0 <= x, y and x + y <= g."""
    if x < 0 or y < 0 or x + y > g:
        raise ValueError(f"advantage_gap: need 0 <= x, y and x + y <= g, got g={g}, x={x}, y={y}")
    pseudo = grpo_advantages([1.0] * x + [0.0] * (g - x))
    gold = grpo_advantages([0.0] * x + [1.0] * y + [0.0] * (g - x - y))
    return math.sqrt(sum((a - b) ** 2 for a, b in zip(pseudo, gold)))


@dataclass(frozen=True)
class GroupVote:
    """What one question's vote says for the CARE score: `voted`, the responses in the majority cluster (0
    without a pseudo-label: a tie, or no answers), and `others`, the sizes of the other clusters."""

    voted: int
    others: tuple[int, ...]


@dataclass
class Calibration:
    """The labeled groups' votes against their gold: how often a vote of x responses is wrong, and how often
    a wrong vote leaves no response right. Counts from the start of the run; add-one smoothed."""

    group_size: int
    total: list[int] = field(default_factory=list)  # [G + 1] labeled groups whose vote had x responses
    wrong: list[int] = field(default_factory=list)  # [G + 1] ... whose majority answer was not the gold
    wrong_none_right: int = 0  # wrong votes with no response right

    def __post_init__(self):
        self.total = self.total or [0] * (self.group_size + 1)
        self.wrong = self.wrong or [0] * (self.group_size + 1)

    def add(self, vote: GroupVote, right: bool, n_right: int) -> None:
        """One labeled group: its vote, whether its majority answer is the gold, how many responses are."""
        self.total[vote.voted] += 1
        if not right:
            self.wrong[vote.voted] += 1
            self.wrong_none_right += n_right == 0

    def p_wrong(self, voted: int) -> float:
        """P(the majority answer is wrong | x responses voted for it); 1 without a pseudo-label."""
        return 1.0 if voted == 0 else (self.wrong[voted] + 1) / (self.total[voted] + 2)

    def p_none_right(self) -> float:
        """P(no response is right | the vote is wrong)."""
        return (self.wrong_none_right + 1) / (sum(self.wrong) + 2)

    def expected_gap(self, vote: GroupVote) -> float:
        """E[advantage_gap]: a wrong vote's right answer is no response with p_none_right, else one of the
        other clusters, in proportion to its size."""
        g = self.group_size
        p0 = self.p_none_right() if vote.others else 1.0
        wrong = p0 * advantage_gap(g, vote.voted, 0)
        total = sum(vote.others)
        for size in vote.others:
            wrong += (1 - p0) * size / total * advantage_gap(g, vote.voted, size)
        return self.p_wrong(vote.voted) * wrong


def tie_order(seed: int, epoch: int, n: int) -> Tensor:
    """[n] a permutation from the run's seed and the epoch: the order among equal scores."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class LabelBuyer:
    """`labels.*` over a run: the CARE statistics of the epoch, what to buy at its end. The bought questions
    themselves are the tracker's (`PassRateTracker.bought`); this object only decides.

    hidden_gold: [Q] the question has a gold the data holds back (only those can be bought); buy_epochs: the
    epoch ends at which labels are bought (the run's epochs but the last), which spreads the budget when
    `per_epoch` is None.
    """

    def __init__(self, config: LabelsConfig, group_size: int, hidden_gold: Tensor, seed: int, buy_epochs: int):
        self.config, self.seed = config, seed
        self.hidden_gold = hidden_gold.bool().clone()  # [Q]
        per_epoch = config.per_epoch or math.ceil(config.budget / max(1, buy_epochs))
        self.per_epoch = min(per_epoch, config.budget)
        self.calibration = Calibration(group_size)
        self.votes: dict[int, GroupVote] = {}  # question -> its latest vote (CARE; candidates only)

    @property
    def active(self) -> bool:
        return self.config.budget > 0

    @property
    def calibrates(self) -> bool:
        """The CARE score reads the labeled groups' votes: grading votes on labeled questions too."""
        return self.active and self.config.acquire == "care"

    def record(self, question: int, vote: GroupVote, labeled: bool, right: bool, n_right: int) -> None:
        """One graded group, from any rank (the same on every rank): a labeled one calibrates, an unlabeled
        one's vote is kept for its score at the epoch end."""
        if labeled:
            self.calibration.add(vote, right, n_right)
        else:
            self.votes[question] = vote

    def buy(self, tracker: PassRateTracker) -> dict | None:
        """At an epoch end (after `tracker.end_epoch`): choose, mark them bought in the tracker, and return the
        labels.jsonl row (epoch, acquire, questions bought and their scores, the spent budget, and whether
        each one's last pseudo-label was right), or None when nothing is bought."""
        spent = int(tracker.bought.sum())
        want = min(self.per_epoch, self.config.budget - spent)
        candidates = (~tracker.labeled & ~tracker.bought & self.hidden_gold).nonzero().squeeze(1)  # [C]
        if want <= 0 or candidates.numel() == 0:
            return None
        scores = self.scores(tracker, candidates)  # [C]
        order = tie_order(self.seed, tracker.epoch, candidates.numel())  # [C]
        ranked = order[torch.sort(scores[order], descending=True, stable=True).indices]
        chosen = candidates[ranked[:want]]
        tracker.add_labels(chosen)
        correct = tracker.last_correct[chosen]
        return {
            "epoch": tracker.epoch,
            "acquire": self.config.acquire,
            "question": chosen.tolist(),
            "score": [round(s, 5) for s in scores[ranked[:want]].tolist()],
            "pseudo_correct": [None if math.isnan(c) else bool(c) for c in correct.tolist()],
            "spent": spent + chosen.numel(),
            "budget": self.config.budget,
        }

    def scores(self, tracker: PassRateTracker, candidates: Tensor) -> Tensor:
        """[C] the acquisition score of each candidate; higher is bought first."""
        acquire = self.config.acquire
        if acquire == "random":
            return torch.zeros(candidates.numel())
        if acquire == "tcs":
            if tracker.epoch == 0 or not tracker.in_database.any():
                return torch.zeros(candidates.numel())
            tcs = similarity_scores(
                tracker.trajectories[candidates],
                tracker.trajectories[tracker.in_database],
                reference=tracker.config.reference,
                standardize=tracker.config.standardize,
            )
            return -tcs
        if acquire == "care":
            unseen = GroupVote(0, ())  # never graded yet: scored as a group without a pseudo-label or answers
            return torch.tensor([self.calibration.expected_gap(self.votes.get(q, unseen)) for q in candidates.tolist()])
        raise ValueError(f"LabelBuyer: unknown labels.acquire {acquire!r}")

    def state_dict(self) -> dict:
        c = self.calibration
        return {
            "calibration": {"total": list(c.total), "wrong": list(c.wrong), "wrong_none_right": c.wrong_none_right},
            "votes": {q: [v.voted, list(v.others)] for q, v in self.votes.items()},
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore exactly; None (a checkpoint from before labels.*) starts empty."""
        if state is None:
            return
        cal = state["calibration"]
        self.calibration = Calibration(
            self.calibration.group_size, list(cal["total"]), list(cal["wrong"]), cal["wrong_none_right"]
        )
        self.votes = {int(q): GroupVote(v[0], tuple(v[1])) for q, v in state["votes"].items()}


def group_vote(vote: Vote) -> GroupVote:
    """A question's `GroupVote` from its vote (each response's cluster, the pseudo-label's)."""
    sizes = vote.sizes()
    voted = next((c for c, a in zip(vote.cluster, vote.agree) if a), None)  # the pseudo-label's cluster
    others = sorted((s for c, s in enumerate(sizes) if c != voted), reverse=True)
    return GroupVote(0 if voted is None else sizes[voted], tuple(others))
