"""Unsupervised rewards from the policy's own token distributions.

Baselines of the paper's Table 1 (section "Unsupervised RLVR" and appendix
"Baseline Description"). Each maps a batch of responses to one scalar per
response; higher means more confident. Shapes: N responses, L positions,
V vocabulary entries; `mask` [N, L] marks response tokens.
"""

from __future__ import annotations

from torch import Tensor

from trapo.algorithm.logits import TokenStats, kl_uniform_to_policy, masked_mean, token_entropy


def confidence_reward(kind: str, stats: TokenStats, mask: Tensor) -> Tensor:
    """One of the three rewards below from per-token statistics already computed ([N, L] each).

    kind: "self_certainty" (needs stats.kl_uniform), "token_entropy" (stats.entropy)
    or "sentence_entropy" (stats.logprobs); mask: [N, L] -> [N].
    """
    if kind == "self_certainty":
        return masked_mean(stats.kl_uniform, mask)
    if kind == "token_entropy":
        return -masked_mean(stats.entropy, mask)
    if kind == "sentence_entropy":
        return (stats.logprobs.float() * mask.float()).sum(dim=1)
    raise ValueError(f"confidence_reward: unknown kind {kind!r}")


def self_certainty_reward(logits: Tensor, mask: Tensor) -> Tensor:
    """Self-certainty (Zhao et al. 2025): mean over response tokens of KL(U || p_t).

        r = (1/|tau|) sum_t [ -log V - (1/V) sum_v log p_t(v) ]

    logits: [N, L, V], mask: [N, L] -> [N]. 0 for a uniform policy, larger
    when the distributions are peaked.
    """
    return confidence_reward("self_certainty", TokenStats(None, None, kl_uniform_to_policy(logits)), mask)


def token_entropy_reward(logits: Tensor, mask: Tensor) -> Tensor:
    """Token-level entropy minimisation (Agarwal et al. 2025): negative mean token entropy.

        r = -(1/|tau|) sum_t H(p_t),   H(p) = -sum_v p(v) log p(v)

    logits: [N, L, V], mask: [N, L] -> [N] (<= 0).
    """
    return confidence_reward("token_entropy", TokenStats(None, token_entropy(logits), None), mask)


def sentence_likelihood_reward(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Sentence-level entropy minimisation (Agarwal et al. 2025): sequence log-likelihood.

        r = log pi(tau | q) = sum_t log p_t(tau_t)

    Maximising it lowers a one-sample estimate of the sequence-level entropy.
    logprobs: [N, L] log-probs of the sampled tokens, mask: [N, L] -> [N] (<= 0).
    """
    return confidence_reward("sentence_entropy", TokenStats(logprobs, None, None), mask)
