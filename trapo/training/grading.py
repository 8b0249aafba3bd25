"""Grading one step's rollouts: rewards, (pseudo) pass rates, pseudo-label precision.

Labeled question: reward = Math-Verify(response, gold), pass rate = mean reward. (Math-Verify, or the
task verifier `reward.verifier` names: `trapo.algorithm.rewards.verifiers`, which then also reads the
answers and keys the vote.)
Unlabeled question: the TTRL pseudo-label is the majority answer over its G
responses; its pseudo pass rate (paper eq. "pass_rate" with the pseudo-label)
is the fraction of responses that agree with it. Its rewards are `reward.unlabeled`'s
(`UnlabeledReward`: from the vote's clusters, and for some kinds the policy's confidence
scores). A hidden gold, when present, is only compared with the pseudo-label (diagnostics),
never used for reward.

Degenerate outputs (the collapse the paper describes for unsupervised
training) cannot stall a step: each Math-Verify comparison has its timeout,
a vote never waits twice on an answer that exhausted it, and an optional
`budget` bounds the whole call; what timed out or was cut counts as not
equal, and is counted in `Grades` for the step's metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trapo.algorithm.acquisition import group_vote
from trapo.algorithm.rewards import Judge, Tally, Vote, answer_rewards, cluster_votes, decide_pairs
from trapo.algorithm.rewards.unlabeled import UnlabeledReward
from trapo.algorithm.rewards.verifiers import extract_answers
from trapo.algorithm.selection import confidence_kind
from trapo.config import Config
from trapo.data import Question
from trapo.engine.batch import build_sequences
from trapo.engine.grading.verifier import default_verifier

if TYPE_CHECKING:
    import torch


@dataclass
class Grades:
    rewards: list[list[float]]  # [b][G]; for unlabeled questions `reward.unlabeled`'s
    pass_rates: list[float]  # [b]
    pseudo_correct: list[float]  # [b]; 1/0 when an unlabeled question's hidden gold is known, else NaN
    timeouts: int = 0  # comparisons (and answers parsed for a vote) that exhausted the Math-Verify timeout
    budget_cut: int = 0  # comparisons left undecided because the step's grading budget was spent
    failed: int = 0  # left undecided: grading processes died on them, or a task verifier's call raised
    # What was compared, for the rollout dump (trapo/training/rollout_dump.py): each response's extracted answer
    # (`extract_answer`, or the task verifier's extract; None without one) [b][G], and each unlabeled
    # question's pseudo-label (the majority answer; None on a tie or for a labeled question) [b].
    answers: list[list[str | None]] = field(default_factory=list)
    pseudo_labels: list[str | None] = field(default_factory=list)
    # [b] each question's vote: every unlabeled one's; a labeled one's only when asked (`vote_labeled`), else None
    votes: list[Vote | None] = field(default_factory=list)

    @classmethod
    def concat(cls, parts: list[Grades]) -> Grades:
        """The grades of several question lists, one after the other (a step's generation rounds)."""
        return cls(
            rewards=[r for g in parts for r in g.rewards],
            pass_rates=[p for g in parts for p in g.pass_rates],
            pseudo_correct=[c for g in parts for c in g.pseudo_correct],
            timeouts=sum(g.timeouts for g in parts),
            budget_cut=sum(g.budget_cut for g in parts),
            failed=sum(g.failed for g in parts),
            answers=[a for g in parts for a in g.answers],
            pseudo_labels=[label for g in parts for label in g.pseudo_labels],
            votes=[v for g in parts for v in g.votes],
        )


def grade(
    questions: list[Question],
    texts: list[list[str]],
    timeout: float,
    verifier: Judge | None = None,
    *,
    budget: float | None = None,
    unlabeled: UnlabeledReward | None = None,
    scores: dict[int, list[float]] | None = None,
    vote_labeled: bool = False,
) -> Grades:
    """questions: [b]; texts: [b][G] response texts.

    timeout: seconds one Math-Verify comparison may take. verifier: the judge (`MathVerifier`, the run's
    `reward.verifier`), None for the process-wide Math-Verify one. budget: seconds
    (wall clock) for the whole call, labeled rewards, votes and hidden-gold
    checks together, or None for no bound; once spent, comparisons not yet
    decided count as not equal and are not sent to the workers. unlabeled: the unlabeled questions' reward
    (`reward.unlabeled`; None: majority), with `scores` {position: [G]} its `score_kind` scores of the
    unlabeled questions. vote_labeled: vote on the labeled questions too (their votes against their gold
    calibrate the CARE label score: `trapo.algorithm.acquisition`).
    """
    unlabeled = UnlabeledReward() if unlabeled is None else unlabeled
    scores = {} if scores is None else scores
    deadline = None if budget is None else time.monotonic() + max(0.0, budget)
    judge = default_verifier() if verifier is None else verifier
    tally = Tally()
    b = len(questions)
    rewards: list[list[float]] = [[] for _ in range(b)]
    pass_rates = [0.0] * b
    pseudo_correct = [math.nan] * b

    # Each answer extracted once: the labeled rewards (`answer_rewards`, `math_rewards` on these answers),
    # the vote and the rollout dump all read the same strings. A task verifier extracts in its workers,
    # under the deadline, and keys each answer for the vote.
    flat_answers, flat_keys = extract_answers([t for group in texts for t in group], judge, timeout, deadline, tally)
    answers, keys, pos = [], [], 0
    for group in texts:
        answers.append(flat_answers[pos : pos + len(group)])
        keys.append(None if flat_keys is None else flat_keys[pos : pos + len(group)])
        pos += len(group)
    pseudo_labels: list[str | None] = [None] * b
    labeled = [i for i, q in enumerate(questions) if q.labeled]
    if labeled:
        flat = answer_rewards(
            [a for i in labeled for a in answers[i]],
            [questions[i].answer for i in labeled for _ in answers[i]],
            judge,
            timeout,
            deadline,
            tally,
        )
        pos = 0
        for i in labeled:
            g = len(texts[i])
            rewards[i] = flat[pos : pos + g]
            pass_rates[i] = sum(rewards[i]) / g
            pos += g

    votes: list[Vote | None] = [None] * b
    voted = [i for i, q in enumerate(questions) if vote_labeled or not q.labeled]
    if voted:
        group_keys = None if flat_keys is None else [keys[i] for i in voted]
        found = cluster_votes([answers[i] for i in voted], judge, timeout, deadline, tally, group_keys)
        for i, vote in zip(voted, found):
            votes[i] = vote
    checks = []  # (question position, hidden gold, pseudo-label)
    for i, q in enumerate(questions):
        if q.labeled:
            continue
        vote = votes[i]
        rewards[i] = unlabeled(vote, scores.get(i))
        pseudo_labels[i] = vote.label
        pass_rates[i] = sum(vote.agree) / len(vote.agree)
        if q.answer is not None:
            if vote.label is None:
                pseudo_correct[i] = 0.0
            else:
                checks.append((i, q.answer, vote.label))
    verdicts = decide_pairs([(g, lab) for _, g, lab in checks], judge, timeout, deadline, tally)
    for (i, _, _), ok in zip(checks, verdicts):
        pseudo_correct[i] = 1.0 if ok else 0.0
    return Grades(
        rewards,
        pass_rates,
        pseudo_correct,
        tally.timeouts,
        tally.budget_cut,
        tally.failed,
        answers,
        pseudo_labels,
        votes,
    )


def confidence_kinds(cfg: Config, labeled: torch.Tensor) -> list[str]:
    """The confidence scores a round needs, each once: the selection strategy's ranking (`entropy`,
    `self_certainty`), and the unlabeled reward when it is a confidence reward (Table 1's baselines).
    The selection's kind is skipped when the data has no labeled or no unlabeled question (there is nothing
    to select), alike on every rank. labeled: [Q] the training questions' flags."""
    kinds = []
    selection = confidence_kind(cfg.selection.strategy)
    if selection is not None and labeled.any() and not labeled.all():
        kinds.append(selection)
    if (reward := unlabeled_reward(cfg).score_kind) is not None:
        kinds.append(reward)
    return list(dict.fromkeys(kinds))


def unlabeled_reward(cfg: Config) -> UnlabeledReward:
    """The run's `reward.unlabeled` with its settings."""
    return UnlabeledReward(cfg.reward.unlabeled, cfg.reward.scrl)


def confidence_scores(
    policy, kinds: list[str], positions: list[int], prompts: list[list[int]], responses: list[list[list[int]]]
) -> dict[str, dict[int, list[float]]]:
    """{kind: {position: its G scores}} of the questions at `positions` (their prompts and [G] responses):
    one policy forward per kind. A forward is collective: every rank scores, maybe nothing."""
    g = len(responses[0]) if responses else 0
    to_score = build_sequences(
        prompts=prompts,
        responses=responses,
        advantages=[[0.0] * g for _ in positions],  # scoring reads tokens only
        gate=[1.0] * len(positions),
        labeled=[False] * len(positions),
    )
    out = {}
    for kind in kinds:
        scores = policy.confidence_scores(to_score, kind)  # [len(positions) * G]
        out[kind] = {pos: scores[n * g : (n + 1) * g] for n, pos in enumerate(positions)}
    return out


def label_votes(question_ids: list[int], questions: list[Question], grades: Grades) -> list[tuple]:
    """The label buyer's rows (`LabelBuyer.record`) of the voted groups: (question, its `GroupVote`, labeled,
    whether a labeled group's majority answer is its gold, how many of its responses are)."""
    rows = []
    for i, q, vote, rewards in zip(question_ids, questions, grades.votes, grades.rewards):
        if vote is not None:
            right = q.labeled and any(r == 1.0 for r, a in zip(rewards, vote.agree) if a)
            rows.append((i, group_vote(vote), q.labeled, right, sum(r == 1.0 for r in rewards) if q.labeled else 0))
    return rows
