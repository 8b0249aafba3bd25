"""Rewards: answers against gold answers, majority vote, confidence baselines.

What compares two answers is a `Judge` the caller passes (`judge.py`): Math-Verify in worker processes
(`trapo.engine.grading`) for the trainer and the evaluation. The confidence rewards need torch; they are
imported on first use so that the grading worker processes (which import this package) start fast.
"""

from trapo.algorithm.rewards.answers import extract_boxed
from trapo.algorithm.rewards.extraction import extract_answer
from trapo.algorithm.rewards.judge import Judge, Verdict
from trapo.algorithm.rewards.verifiable import (
    Tally,
    Vote,
    answer_rewards,
    cluster_votes,
    decide_pairs,
    judge_pairs,
    majority_vote,
    majority_votes,
    math_reward,
    math_rewards,
)

_CONFIDENCE = ("self_certainty_reward", "token_entropy_reward", "sentence_likelihood_reward")

__all__ = [
    "Judge",
    "Tally",
    "Verdict",
    "Vote",
    "answer_rewards",
    "cluster_votes",
    "decide_pairs",
    "extract_answer",
    "extract_boxed",
    "judge_pairs",
    "majority_vote",
    "majority_votes",
    "math_reward",
    "math_rewards",
    *_CONFIDENCE,
]


def __getattr__(name: str):
    if name in _CONFIDENCE:
        from trapo.algorithm.rewards import confidence

        return getattr(confidence, name)
    raise AttributeError(f"module 'trapo.algorithm.rewards' has no attribute {name!r}")
