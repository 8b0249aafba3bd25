"""Selection strategies: which unlabeled questions join the loss at an epoch end.

Paper section "Different Selection Strategies" and tables "select_method" /
"random_select": at a fixed selection ratio, TraPO's TCS ranking is compared
with
  - random selection (no ranking),
  - sentence-level entropy: a question whose responses have lower sentence
    entropy is taken as more reliable; ranked by the mean over its G responses
    of the sequence log-likelihood log pi(o | q) (trapo/algorithm/rewards/confidence.py,
    kind "sentence_entropy": higher = lower entropy),
  - self-certainty: higher = more reliable; ranked by the mean over its G
    responses of KL(U || p) per token (kind "self_certainty").

How many are taken: with `fixed_ratio = r`, exactly floor(r * U) of the U
unlabeled questions. Without it, the paper's rule M(u) = top-p(TCS) OR
TCS >= Gamma decides the set for "tcs", and only the count for the other
strategies (a count-matched control, as the paper's random control).

All functions are pure; `trapo.algorithm.passrate.PassRateTracker` holds the state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trapo.config import STRATEGIES

# strategy -> the confidence_reward kind whose per-question mean it ranks by
CONFIDENCE_KINDS = {"entropy": "sentence_entropy", "self_certainty": "self_certainty"}


def confidence_kind(strategy: str) -> str | None:
    """The `confidence_reward` kind a strategy needs from the policy, or None ("tcs", "random")."""
    if strategy not in STRATEGIES:
        raise ValueError(f"confidence_kind: strategy must be one of {STRATEGIES}, got {strategy!r}")
    return CONFIDENCE_KINDS.get(strategy)


def fixed_count(ratio: float, n: int) -> int:
    """floor(ratio * n); the epsilon keeps 0.29 * 100 at 29, not the 28 that float rounding gives."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"fixed_count: ratio must be in [0, 1], got {ratio}")
    return min(n, math.floor(ratio * n + 1e-9))


def top_k_mask(scores: Tensor, k: int) -> Tensor:
    """The k highest scores: [N] -> BoolTensor [N].

    NaN (a question never scored) ranks below every number; equal scores at
    the cut go to the lower index (a stable sort), so the result is
    deterministic. k is clipped to [0, N].
    """
    n = scores.numel()
    mask = torch.zeros(n, dtype=torch.bool)
    k = max(0, min(int(k), n))
    if k == 0:
        return mask
    key = torch.nan_to_num(scores.float().cpu(), nan=-math.inf)  # [N]
    order = torch.argsort(key, descending=True, stable=True)  # [N]
    mask[order[:k]] = True
    return mask


def random_mask(n: int, k: int, seed: int) -> Tensor:
    """k of n chosen uniformly without replacement by a generator seeded with `seed`: BoolTensor [n]."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=gen)[: max(0, min(int(k), n))]] = True
    return mask


def random_seed_for(seed: int | None, epoch: int) -> int:
    """The random strategy's generator seed at an epoch end: one stream per (run seed, epoch)."""
    return (seed or 0) * 100_003 + epoch


def select(
    strategy: str,
    tcs_scores: Tensor,
    confidence: Tensor | None,
    rule: Tensor,
    *,
    fixed_ratio: float | None,
    seed: int,
) -> tuple[Tensor, Tensor]:
    """The selected unlabeled questions and the scores they were ranked by.

    tcs_scores: [U] TCS; confidence: [U] mean confidence score of each
    question's G responses this epoch (NaN unscored; needed for "entropy" and
    "self_certainty"); rule: [U] bool, the paper's M(u) = top-p OR TCS >= Gamma;
    fixed_ratio: None (the rule's count) or r in [0, 1] (floor(r * U));
    seed: the random strategy's generator seed.
    Returns (chosen [U] bool, ranking score [U] float: TCS, the confidence,
    or NaN for "random", which ranks nothing).
    """
    u = tcs_scores.numel()
    if tcs_scores.shape != rule.shape:
        raise ValueError(f"select: tcs_scores {tuple(tcs_scores.shape)} and rule {tuple(rule.shape)} differ")
    count = int(rule.sum()) if fixed_ratio is None else fixed_count(fixed_ratio, u)
    if strategy == "tcs":
        chosen = rule.clone() if fixed_ratio is None else top_k_mask(tcs_scores, count)
        return chosen, tcs_scores.float().clone()
    if strategy == "random":
        return random_mask(u, count, seed), torch.full((u,), math.nan)
    if strategy not in CONFIDENCE_KINDS:
        raise ValueError(f"select: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if confidence is None or confidence.shape != tcs_scores.shape:
        got = None if confidence is None else tuple(confidence.shape)
        raise ValueError(f"select: strategy {strategy!r} needs confidence scores [{u}], got {got}")
    return top_k_mask(confidence, count), confidence.float().clone()
