"""GRPO / Dr.GRPO advantages, the clipped policy loss (paper eq. "grpo") and
the truncated importance weights that correct for the rollout engine's
sampling distribution.

Pure functions on tensors: no I/O, no distributed calls. Shapes use
B questions, G rollouts per question, N = B * G sequences, L response
positions (right-padded; `mask` marks real response tokens).

Defaults follow the paper's appendix "Implementation Details": Dr.GRPO
(no std scaling of advantages, no length normalisation of the loss),
beta = 0 (no KL to a reference policy), entropy coefficient 0.01.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_SCALES = ("none", "std")
AGGREGATIONS = ("dr_grpo", "token_mean", "seq_mean")
ROLLOUT_IS_CAP = 2.0  # TRL's default cap for the truncated rollout importance weight


def group_advantages(rewards: Tensor, scale: str = "none") -> Tensor:
    """Group-relative advantages A_ij = r_ij - mean_j(r_ij) [/ (std_j(r_ij) + 1e-6)].

    rewards: [B, G] -> [B, G] float32.
    scale="none" is Dr.GRPO (the default); scale="std" is the original GRPO,
    dividing by the group's unbiased std (torch.std) + 1e-6. A group whose
    rewards are all equal carries no signal and gets zero advantage; so does
    a group of one (its std is undefined and treated as 0).
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"group_advantages: scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if rewards.dim() != 2:
        raise ValueError(f"group_advantages: rewards must be [B, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # [B, G]
    if scale == "none" or rewards.shape[1] < 2 or rewards.numel() == 0:  # G < 2: all zeros
        return centered
    std = rewards.std(dim=1, keepdim=True)  # [B, 1], unbiased
    return centered / (std + 1e-6)


def rollout_is_weights(
    old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, *, cap: float = ROLLOUT_IS_CAP
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights w = min(pi_old / pi_engine, C) = min(exp(old - engine), C), per token.

    The rollout engine (vLLM) samples with log-probs that differ slightly from
    the trainer's for the same weights, so its tokens are slightly off-policy
    for pi_old; weighting each token's policy-gradient term by w corrects for
    that, and the cap C bounds the variance (truncated IS, "TIS").

    old_logprobs (trainer's pi_old), engine_logprobs (the sampler's), mask:
    [N, L]. Returns (weights [N, L] float32, detached, 0 at padding; metrics
    with detached scalars is_weight_mean (mean w over masked tokens) and
    is_capped_frac (fraction of masked tokens where the cap applied)).
    """
    if not cap > 0.0:
        raise ValueError(f"rollout_is_weights: cap must be > 0, got {cap}")
    if old_logprobs.dim() != 2:
        raise ValueError(f"rollout_is_weights: old_logprobs must be [N, L], got shape {tuple(old_logprobs.shape)}")
    for name, t in (("engine_logprobs", engine_logprobs), ("mask", mask)):
        if t.shape != old_logprobs.shape:
            raise ValueError(
                f"rollout_is_weights: {name} must be [N, L]={list(old_logprobs.shape)} like old_logprobs, "
                f"got {tuple(t.shape)}"
            )
    with torch.no_grad():  # weights are constants of the loss: no gradient flows through pi_old or pi_engine
        mask = mask.bool()
        # Padding may hold anything (even -inf); zero its log-ratio so exp() stays finite.
        log_ratio = torch.where(mask, old_logprobs.float() - engine_logprobs.float(), 0.0)  # [N, L]
        raw = log_ratio.exp()
        weights = torch.where(mask, raw.clamp(max=cap), 0.0)  # [N, L]
        count = mask.sum().clamp_min(1)
        metrics = {
            "is_weight_mean": weights.sum() / count,
            "is_capped_frac": (mask & (raw > cap)).sum() / count,
        }
    return weights, metrics


def _aggregate(terms: Tensor, mask: Tensor, weights: Tensor, agg: str, denom: float | None) -> Tensor:
    """Reduce per-token terms [N, L] to a scalar.

    The weights [N] multiply each sequence's terms; denominators never depend
    on them, so a gated sequence (weight 0) adds nothing to the numerator and
    the labeled terms keep the scale they would have in the full batch
    (L = J_labeled + M * J_unlabeled, read literally).
    """
    n, length = mask.shape
    weighted = terms * mask * weights[:, None]  # [N, L]
    if agg == "dr_grpo":
        # Dr.GRPO: a constant denominator, so long and short responses weigh
        # the same per token (no length bias).
        return weighted.sum() / (denom if denom is not None else max(n * length, 1))
    if agg == "token_mean":
        # Paper eq. "grpo": 1 / sum_i |tau_i|.
        return weighted.sum() / (denom if denom is not None else mask.sum().clamp_min(1.0))
    # seq_mean: each sequence's token mean, then the mean over sequences.
    per_seq = weighted.sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)  # [N]
    return per_seq.sum() / (denom if denom is not None else max(n, 1))


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    weights: Tensor | None = None,
    agg: str = "dr_grpo",
    denom: float | None = None,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.01,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss of GRPO (paper eq. "grpo"), to be minimised.

    Per token: -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A),
    ratio = exp(logprobs - old_logprobs).

    logprobs, old_logprobs, mask: [N, L]; advantages: [N];
    weights: [N] or None (the paper's gate M: 0 drops a sequence's terms and
    their gradient; default all ones);
    ref_logprobs: [N, L], used when beta > 0 for the k3 KL estimator
    exp(ref - lp) - (ref - lp) - 1;
    entropy: [N, L] token entropies (`trapo.logits.token_entropy`), used for
    the bonus -entropy_coef * H when given.
    token_weights: [N, L] or None, per-token constants multiplying the
    policy-gradient term only (not the KL or entropy terms), e.g. the rollout
    importance weights of `rollout_is_weights`; treated as detached.
    agg: "dr_grpo" (sum / (N * L)), "token_mean" (sum / number of masked
    tokens) or "seq_mean" (mean over sequences of each one's token mean).
    denom: the denominator to use instead of this batch's (N * L, token count
    or N); pass the full batch's value when the batch is split into
    micro-batches so that their gradients add up to the full batch's.

    Returns (loss scalar, metrics) with detached scalar metrics: pg_loss,
    clip_frac, ratio_mean, approx_kl_old (k3 estimate of KL(old || new)),
    and kl_ref / entropy when used. Metrics average over masked tokens of
    sequences with non-zero weight.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"policy_loss: agg must be one of {AGGREGATIONS}, got {agg!r}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            "policy_loss: logprobs, old_logprobs and mask must share one [N, L] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    n = logprobs.shape[0]
    if advantages.shape != (n,):
        raise ValueError(f"policy_loss: advantages must be [N]=[{n}], got {tuple(advantages.shape)}")
    if weights is None:
        weights = torch.ones(n, device=logprobs.device)
    elif weights.shape != (n,):
        raise ValueError(f"policy_loss: weights must be [N]=[{n}], got {tuple(weights.shape)}")
    if token_weights is not None and token_weights.shape != mask.shape:
        raise ValueError(
            f"policy_loss: token_weights must be [N, L]={list(mask.shape)} like mask, got {tuple(token_weights.shape)}"
        )
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    mask = mask.bool()
    weights = weights.float()
    maskf = mask.float()
    adv = advantages.float()[:, None]  # [N, 1]
    # Padding may hold anything (even inf); zero the log-ratio there so that
    # exp() stays finite and no NaN leaks into the gradient.
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0)  # [N, L]
    ratio = log_ratio.exp()  # [N, L]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high) * adv
    pg_terms = -torch.minimum(unclipped, clipped)  # [N, L]
    if token_weights is not None:
        # Off-policy correction of the sampled tokens: w * pg term. Detached because w is a
        # ratio of fixed behaviour policies; padding garbage becomes a neutral 1 (masked later).
        pg_terms = pg_terms * torch.where(mask, token_weights.detach().float(), 1.0)

    pg_loss = _aggregate(pg_terms, maskf, weights, agg, denom)
    loss = pg_loss
    metrics: dict[str, Tensor] = {}

    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("policy_loss: beta != 0 needs ref_logprobs")
        ref_diff = torch.where(mask, ref_logprobs.float() - logprobs.float(), 0.0)  # [N, L]
        kl_terms = ref_diff.exp() - ref_diff - 1.0  # k3 >= 0
        loss = loss + beta * _aggregate(kl_terms, maskf, weights, agg, denom)
        metrics["kl_ref"] = kl_terms
    if entropy is not None and entropy_coef != 0.0:
        ent = torch.where(mask, entropy.float(), 0.0)
        loss = loss - entropy_coef * _aggregate(ent, maskf, weights, agg, denom)
        metrics["entropy"] = ent

    with torch.no_grad():
        active = mask & (weights[:, None] != 0)  # [N, L]
        count = active.sum().clamp_min(1)

        def token_avg(x: Tensor) -> Tensor:
            return (x.detach() * active).sum() / count

        clip_hit = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        out = {
            "pg_loss": pg_loss.detach(),
            "clip_frac": token_avg(clip_hit.float()),
            "ratio_mean": token_avg(ratio),
            "approx_kl_old": token_avg(ratio - 1.0 - log_ratio),
        }
        out.update({k: token_avg(v) for k, v in metrics.items()})
    return loss, out
