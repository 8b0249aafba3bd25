"""Per-token statistics computed from a policy's logits.

Pure tensor functions shared by the loss (entropy bonus, log-probs of the
sampled tokens) and by the confidence rewards (self-certainty, entropy).
Shapes: N sequences, L positions, V vocabulary entries.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(tokens[n, l]) under softmax(logits[n, l]).

    logits: [N, L, V], tokens: [N, L] (int64) -> [N, L] float32.
    Computed as z[token] - logsumexp(z): no [N, L, V] log-softmax is
    materialised, which matters at V = 150k.
    """
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, L]
    return picked - torch.logsumexp(logits, dim=-1)  # [N, L]


def token_entropy(logits: Tensor) -> Tensor:
    """Shannon entropy H(p) = -sum_v p_v log p_v of softmax(logits), per position.

    logits: [N, L, V] -> [N, L] float32 (nats).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, L, V]
    return -(logp.exp() * logp).sum(dim=-1)  # [N, L]


def kl_uniform_to_policy(logits: Tensor) -> Tensor:
    """KL(U || p) per position, U the uniform distribution over V entries.

    KL(U || p) = sum_v (1/V) (log(1/V) - log p_v) = logsumexp(z) - mean_v(z) - log V.
    logits: [N, L, V] -> [N, L] float32. Zero exactly when p is uniform.
    """
    z = logits.float()
    vocab = z.shape[-1]
    return torch.logsumexp(z, dim=-1) - z.mean(dim=-1) - math.log(vocab)  # [N, L]


def masked_mean(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Mean of values over positions where mask is true; 0 where none are.

    values, mask: [N, L] -> [N] for dim=-1.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum(dim=dim)
    count = mask.sum(dim=dim)
    return total / count.clamp_min(1.0)
