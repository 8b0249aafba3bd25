"""Grading one step's rollouts: rewards, (pseudo) pass rates, pseudo-label precision.

Labeled question: reward = Math-Verify(response, gold), pass rate = mean reward.
Unlabeled question: the TTRL pseudo-label is the majority answer over its G
responses; its pseudo pass rate (paper eq. "pass_rate" with the pseudo-label)
is the fraction of responses that agree with it, and with the `majority`
reward each agreeing response scores 1. A hidden gold, when present, is only
compared with the pseudo-label (diagnostics), never used for reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trapo.data import Question
from trapo.rewards import decide_pairs, extract_boxed, majority_votes, math_rewards


@dataclass
class Grades:
    rewards: list[list[float]]  # [b][G]; for unlabeled questions the majority-vote reward
    pass_rates: list[float]  # [b]
    pseudo_correct: list[float]  # [b]; 1/0 when an unlabeled question's hidden gold is known, else NaN


def grade(questions: list[Question], texts: list[list[str]], timeout: float, verifier=None) -> Grades:
    """questions: [b]; texts: [b][G] response texts."""
    b = len(questions)
    rewards: list[list[float]] = [[] for _ in range(b)]
    pass_rates = [0.0] * b
    pseudo_correct = [math.nan] * b

    labeled = [i for i, q in enumerate(questions) if q.labeled]
    if labeled:
        flat = math_rewards(
            [t for i in labeled for t in texts[i]],
            [questions[i].answer for i in labeled for _ in texts[i]],
            timeout,
            verifier,
        )
        pos = 0
        for i in labeled:
            g = len(texts[i])
            rewards[i] = flat[pos : pos + g]
            pass_rates[i] = sum(rewards[i]) / g
            pos += g

    unlabeled = [i for i, q in enumerate(questions) if not q.labeled]
    if unlabeled:
        votes = majority_votes([[extract_boxed(t) for t in texts[i]] for i in unlabeled], timeout, verifier)
        checks = []  # (question position, hidden gold, pseudo-label)
        for i, (label, agree) in zip(unlabeled, votes):
            rewards[i] = [1.0 if a else 0.0 for a in agree]
            pass_rates[i] = sum(agree) / len(agree)
            gold = questions[i].answer
            if gold is not None:
                if label is None:
                    pseudo_correct[i] = 0.0
                else:
                    checks.append((i, gold, label))
        for (i, _, _), ok in zip(checks, decide_pairs([(g, lab) for _, g, lab in checks], timeout, verifier)):
            pseudo_correct[i] = 1.0 if ok else 0.0
    return Grades(rewards, pass_rates, pseudo_correct)
