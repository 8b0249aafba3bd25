"""Benchmark accuracy from sampled responses: avg@k and the unbiased pass@k estimator.

avg@k is the mean over questions of the fraction of a question's k samples that are correct (with k = 1
it is pass@1); pass@K is 1 - C(n - c, K) / C(n, K) from n samples of which c are correct (Chen et al.
2021, "Evaluating Large Language Models Trained on Code", eq. 1). Pure functions on lists of correct flags.
"""

from __future__ import annotations

import math


def avg_at_k(grades: list[list[bool]]) -> float:
    """Mean over questions of the fraction of its k samples that are correct. grades: [Q][k]."""
    if not grades:
        return 0.0
    return sum(sum(g) / len(g) for g in grades) / len(grades)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per question, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(grades: list[list[bool]], k: int) -> float:
    return sum(pass_at_k(len(g), sum(g), k) for g in grades) / len(grades) if grades else 0.0
