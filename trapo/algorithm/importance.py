"""Rollout importance correction: per-token weights for the mismatch between the rollout engine's
sampling distribution (vLLM) and the trainer's pi_old for the same weights (`loss.rollout_is`).

Pure functions on tensors. Shapes: N sequences, L response positions
(right-padded; `mask` marks real response tokens). The token ratio is
r_t = pi_old(y_t) / pi_engine(y_t) = exp(old_t - engine_t).

Modes (the weight w_t multiplies each token's policy-gradient term, see `trapo.algorithm.loss.policy_loss`):
    truncate       w_t = min(r_t, cap)                                   truncated IS, "TIS" (TRL's default)
    token_mask     w_t = r_t if lower <= r_t <= cap else 0               IcePop: IS inside the band, tokens
                                                                         outside it leave the loss
    sequence_mask  w_t = s_i if lower <= s_i <= cap else 0, for every    sequence-level IS with rejection;
                   token of sequence i, s_i = exp(mean_t log r_t)        s_i is the GEOMETRIC mean of the
                                                                         token ratios (their product would
                                                                         shrink or explode with length)
    off            no weights
lower defaults to 1 / cap (veRL's rollout_is_threshold_lower: null = the reciprocal of the upper bound).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trapo.config import ROLLOUT_IS_MODES

ROLLOUT_IS_CAP = 2.0  # TRL's default cap for the truncated rollout importance weight


def resolve_mode(mode: str | bool | None, on_gpu: bool) -> str:
    """`loss.rollout_is` as run: None is "truncate" with a GPU (where vLLM's and the trainer's kernels
    differ) and "off" on CPU (both run the same fp32 math and the ratio is 1 to ~1e-6). False is "off"
    (YAML 1.1 reads a bare `off` as false), True "truncate" (what the earlier boolean switch meant)."""
    if mode is None:
        return "truncate" if on_gpu else "off"
    if isinstance(mode, bool):
        return "truncate" if mode else "off"
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is mode must be one of {ROLLOUT_IS_MODES} or None, got {mode!r}")
    return mode


def top_p_bias_warning(mode: str, top_p: float) -> str | None:
    """The start-up line for rollout IS with nucleus sampling, or None when there is no bias.

    vLLM 0.32 (v1/sample/ops/topk_topp_sampler.py, `forward_native` / `forward_cpu`) applies top-p by
    setting the logits outside the nucleus to -inf and, in logprobs_mode "processed_logprobs" (ours,
    trapo/engine/rollout.py), returns log_softmax of those masked logits: log pi_engine = log p - log Z, Z the
    nucleus's mass under p. The trainer's pi_old is the full softmax, so every ratio carries a factor Z <= 1.
    """
    if mode == "off" or top_p >= 1.0:
        return None
    return (
        f"loss.rollout_is={mode} with rollout.top_p={top_p}: vLLM renormalises its sampled log-probs over the "
        "top-p nucleus, so pi_old / pi_engine is scaled down by the nucleus's mass Z <= 1 at every token "
        "(truncate shrinks the weights, the mask modes drop high-entropy tokens); use rollout.top_p=1 or "
        "loss.rollout_is=off"
    )


def rollout_is_weights(
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: str = "truncate",
    cap: float = ROLLOUT_IS_CAP,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Rollout importance weights per token (module docstring: the modes and their equations).

    old_logprobs (trainer's pi_old), engine_logprobs (the sampler's), mask: [N, L]; each row one whole
    sequence. mode: "truncate", "token_mask" or "sequence_mask"; cap: the upper bound; lower: the mask
    modes' lower bound (None: 1 / cap).

    Returns (weights [N, L] float32, detached, 0 at padding; metrics, detached scalars):
        is_weight_mean   mean w over masked tokens
        is_capped_frac   share of masked tokens whose r_t exceeds cap
        is_masked_frac   share of masked tokens whose weight a mask mode set to 0 (0 for truncate)
        is_masked_seqs   number of sequences with at least one such token (sequence_mask: dropped ones)
        is_seqs          number of sequences with at least one response token
    """
    if mode not in ROLLOUT_IS_MODES or mode == "off":
        raise ValueError(f"rollout_is_weights: mode must be one of {ROLLOUT_IS_MODES[:-1]}, got {mode!r}")
    if not cap > 0.0:
        raise ValueError(f"rollout_is_weights: cap must be > 0, got {cap}")
    lower = 1.0 / cap if lower is None else lower
    if not 0.0 <= lower <= cap:
        raise ValueError(f"rollout_is_weights: lower must be in [0, cap={cap}], got {lower}")
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
        raw = log_ratio.exp()  # [N, L]
        if mode == "truncate":
            weights = raw.clamp(max=cap)
            dropped = torch.zeros_like(mask)
        elif mode == "token_mask":
            dropped = (raw < lower) | (raw > cap)  # [N, L]
            weights = raw
        else:  # sequence_mask: the geometric mean exp(mean_t log r_t), not the product
            lengths = mask.sum(dim=1).clamp_min(1)  # [N]
            seq_ratio = (log_ratio.sum(dim=1) / lengths).exp()  # [N]
            dropped = ((seq_ratio < lower) | (seq_ratio > cap))[:, None].expand_as(mask)  # [N, L]
            weights = seq_ratio[:, None].expand_as(raw)
        dropped = dropped & mask
        weights = torch.where(mask & ~dropped, weights, 0.0)  # [N, L]
        count = mask.sum().clamp_min(1)
        metrics = {
            "is_weight_mean": weights.sum() / count,
            "is_capped_frac": (mask & (raw > cap)).sum() / count,
            "is_masked_frac": dropped.sum() / count,
            "is_masked_seqs": dropped.any(dim=1).sum().float(),
            "is_seqs": mask.any(dim=1).sum().float(),
        }
    return weights, metrics
