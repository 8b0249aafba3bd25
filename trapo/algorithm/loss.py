"""GRPO / Dr.GRPO advantages, DAPO's overlong reward shaping, and the policy
loss: the clipped GRPO surrogate (paper eq. "grpo"), GSPO's sequence-level
variant or CISPO's clipped-IS-weight REINFORCE (`loss.objective`). The rollout
importance weights that multiply it live in `trapo.algorithm.importance`.
`LossSpec` is the run's loss rules, decided once from the config (by the training
layer); `PolicyLoss`, built once from it, is the loss the engine calls on each
micro-batch, and the update shapes rewards and counts denominators by it.

Pure functions on tensors: no I/O, no distributed calls. Shapes use
B questions, G rollouts per question, N = B * G sequences, L response
positions (right-padded; `mask` marks real response tokens).

Defaults follow the paper's appendix "Implementation Details": Dr.GRPO
(no std scaling of advantages, no length normalisation of the loss),
beta = 0 (no KL to a reference policy), entropy coefficient 0.01.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trapo.algorithm.importance import resolve_mode, rollout_is_weights
from trapo.config import ADVANTAGE_SCALES, AGGREGATIONS, ENTROPY_AGGS, OBJECTIVES


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


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment R_len (arXiv 2503.14476, eq. 13), added to each response's reward.

    With L_max = max_tokens and L_cache = buffer, for a response of |y| tokens:
        R_len = 0                                         if |y| <= L_max - L_cache
        R_len = ((L_max - L_cache) - |y|) / L_cache * f   if L_max - L_cache < |y| <= L_max
        R_len = -f                                        if |y| > L_max
    (f = factor; DAPO uses 1). lengths: any shape, response token counts -> the same shape, float32, <= 0.
    A response cut at max_tokens has |y| = L_max and gets -f.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong_penalty: buffer must be in (0, max_tokens={max_tokens}], got {buffer}")
    lengths = lengths.float()
    expected = max_tokens - buffer  # L_max - L_cache: the length that is still free of penalty
    ramp = (expected - lengths) / buffer * factor
    return torch.where(lengths <= expected, 0.0, torch.where(lengths <= max_tokens, ramp, -factor))


def loss_denominator(agg: str, num_sequences: int, num_tokens: int, max_tokens: int) -> float:
    """The full update batch's denominator for `policy_loss(..., denom=)`.

    dr_grpo: N * max_tokens (Dr.GRPO's constant generation budget, so a
    token's weight does not depend on how long the other responses are);
    token_mean: the number of response tokens; seq_mean: N. Counted over
    every sequence of the update batch on all ranks, gated ones included.
    """
    if agg == "dr_grpo":
        return float(max(num_sequences * max_tokens, 1))
    if agg == "token_mean":
        return float(max(num_tokens, 1))
    return float(max(num_sequences, 1))


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


def entropy_bonus(
    entropy: Tensor, mask: Tensor, weights: Tensor, agg: str, denom: float | None, entropy_agg: str, entropy_denom
) -> Tensor:
    """The bonus's reduction of token entropies [N, L]: like the loss (entropy_agg "loss": `agg`, `denom`) or
    their mean over the response tokens ("token_mean": / `entropy_denom`, else this batch's token count).
    Under dr_grpo "loss" is sum(H) / (N * L_max): every extra token adds its entropy, so the bonus grows with
    response length; the token mean is length-free (docs/policy-update.md)."""
    if entropy_agg == "token_mean":
        return _aggregate(entropy, mask, weights, "token_mean", entropy_denom)
    return _aggregate(entropy, mask, weights, agg, denom)


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
    entropy_agg: str = "loss",
    entropy_denom: float | None = None,
    token_weights: Tensor | None = None,
    objective: str = "grpo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss, to be minimised; per-token terms, then `agg`.

    objective (r_t = exp(logprobs - old_logprobs), eps_low = clip_eps, eps_high = clip_eps_high or clip_eps):
      "grpo"  GRPO's clipped surrogate (paper eq. "grpo"), per token
              -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A).
      "gspo"  GSPO (arXiv 2507.18071): the same clipped surrogate on the sequence ratio
              s_i = exp(mean_t (logprobs - old_logprobs)) (the geometric mean of the token ratios),
              in its token form s_i,t = sg[s_i] * pi_t / sg[pi_t]: every token's value is s_i, its
              gradient flows through its own log pi_t; the clip (and a zero gradient) applies to the
              whole sequence. Pass GSPO's own small range as clip_eps / clip_eps_high (paper 3e-4 / 4e-4).
              The paper's objective is the mean over sequences of the token mean: agg="seq_mean".
      "cispo" CISPO (MiniMax-M1, arXiv 2506.13585), per token -sg(min(r_t, 1 + eps_high)) A log pi_t:
              a REINFORCE term weighted by the clipped, detached IS ratio, so no token loses its
              gradient. No lower bound (the paper's choice: eps_low "set to a large value"). Computed as
              -sg(min(r_t, 1 + eps_high)) A pi_t / sg[pi_t]: the same gradient, and a value (-w A) that
              does not depend on log pi, comparable with the other objectives' pg_loss.
    For every objective the gate weights, token_weights and denominators below apply the same way:
    token_weights multiply each token's term, weights each sequence's, and agg / denom reduce.

    logprobs, old_logprobs, mask: [N, L]; advantages: [N];
    weights: [N] or None (the paper's gate M: 0 drops a sequence's terms and
    their gradient; default all ones);
    ref_logprobs: [N, L], used when beta > 0 for the k3 KL estimator
    exp(ref - lp) - (ref - lp) - 1;
    entropy: [N, L] token entropies (`trapo.algorithm.logits.token_entropy`), used for
    the bonus -entropy_coef * H when given (and measured: the `entropy` metric, also when entropy_coef is 0).
    entropy_agg: how the bonus reduces H: "loss", like the loss (`agg`, `denom`; under dr_grpo a sum over
    tokens / (N * L_max): it grows with response length), or "token_mean", over the response tokens
    (`entropy_denom`: the full batch's token count, else this batch's): the mean does not grow with length.
    token_weights: [N, L] or None, per-token constants multiplying the
    policy-gradient term only (not the KL or entropy terms), e.g. the rollout
    importance weights of `trapo.algorithm.importance.rollout_is_weights`; treated as detached.
    agg: "dr_grpo" (sum / (N * L)), "token_mean" (sum / number of masked
    tokens) or "seq_mean" (mean over sequences of each one's token mean).
    denom: the denominator to use instead of this batch's (N * L, token count
    or N); pass the full batch's value when the batch is split into
    micro-batches so that their gradients add up to the full batch's.

    Returns (loss scalar, metrics) with detached scalar metrics: pg_loss,
    clip_frac (grpo: tokens whose clip is active; gspo: tokens of sequences whose clip is active;
    cispo: tokens whose IS weight hit 1 + eps_high), ratio_mean, approx_kl_old (k3 estimate of KL(old || new)),
    and kl_ref / entropy when used. Metrics average over masked tokens of
    sequences with non-zero weight.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"policy_loss: agg must be one of {AGGREGATIONS}, got {agg!r}")
    if entropy_agg not in ENTROPY_AGGS:
        raise ValueError(f"policy_loss: entropy_agg must be one of {ENTROPY_AGGS}, got {entropy_agg!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"policy_loss: objective must be one of {OBJECTIVES}, got {objective!r}")
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
    lp = torch.where(mask, logprobs.float(), 0.0)  # [N, L]
    log_ratio = torch.where(mask, lp - old_logprobs.float(), 0.0)  # [N, L], token log-ratios
    if objective == "gspo":
        # log s_i,t = sg[log s_i] + log pi_t - sg[log pi_t]; the mean, not the sum, over the sequence.
        seq_log_ratio = log_ratio.sum(dim=1) / maskf.sum(dim=1).clamp_min(1.0)  # [N]
        ratio = torch.where(mask, (seq_log_ratio.detach()[:, None] + lp - lp.detach()), 0.0).exp()  # [N, L]
    else:
        ratio = log_ratio.exp()  # [N, L]
    if objective == "cispo":
        is_weight = ratio.detach().clamp(max=1.0 + eps_high)  # sg(clip(r_t)), upper bound only
        pg_terms = -is_weight * adv * (lp - lp.detach()).exp()  # [N, L]; d/d lp = -w A, value -w A
        clip_hit = ratio > 1.0 + eps_high
    else:
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high) * adv
        pg_terms = -torch.minimum(unclipped, clipped)  # [N, L]
        clip_hit = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
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
    if entropy is not None:
        ent = torch.where(mask, entropy.float(), 0.0)
        metrics["entropy"] = ent
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy_bonus(ent, maskf, weights, agg, denom, entropy_agg, entropy_denom)

    with torch.no_grad():
        active = mask & (weights[:, None] != 0)  # [N, L]
        count = active.sum().clamp_min(1)

        def token_avg(x: Tensor) -> Tensor:
            return (x.detach() * active).sum() / count

        out = {
            "pg_loss": pg_loss.detach(),
            "clip_frac": token_avg(clip_hit.float()),
            "ratio_mean": token_avg(ratio),  # gspo: the sequence ratios s_i, token-weighted
            "approx_kl_old": token_avg(log_ratio.exp() - 1.0 - log_ratio),
        }
        out.update({k: token_avg(v) for k, v in metrics.items()})
    return loss, out


@dataclass(frozen=True)
class LossSpec:
    """The loss a run trains with, decided once from `cfg.loss` (with rollout.max_tokens and
    train.skip_zero_advantage) by `trapo.training.settings.loss_spec`: `PolicyLoss` runs it,
    `trapo.training.update` shapes rewards by it."""

    objective: str  # OBJECTIVES
    clip_eps: float  # the objective's clip below 1 (GSPO: its own small range, loss.gspo_clip_eps)
    clip_eps_high: float | None  # and above 1 (None: clip_eps)
    agg: str  # AGGREGATIONS
    max_tokens: int  # L_max, rollout.max_tokens: dr_grpo's constant denominator and the overlong rules' cut
    entropy_coef: float  # the bonus's weight; with entropy_target, the adaptive coefficient's start
    beta: float  # the k3 KL term's weight
    advantage_scale: str  # ADVANTAGE_SCALES
    overlong: str  # "none", "mask" (drop responses cut at L_max) or "soft_penalty" (DAPO's R_len)
    overlong_buffer: int  # L_cache in tokens (soft_penalty)
    overlong_penalty: float  # R_len at and past L_max is -overlong_penalty
    # loss.rollout_is as configured (unset under rollout.max_staleness > 0: truncate, stale rounds need it);
    # `importance.resolve_mode` picks the mode
    rollout_is: str | bool | None
    rollout_is_cap: float
    rollout_is_lower: float | None
    skip_zero_advantage: bool | None = None  # train.skip_zero_advantage; None: skip when exact
    entropy_agg: str = "loss"  # ENTROPY_AGGS: the bonus reduced like the loss, or a per-token mean
    entropy_target: float | None = None  # loss.entropy_target: the coefficient is adapted (entropy_control)

    @property
    def zero_advantage_no_gradient(self) -> bool:
        """Whether a sequence with advantage 0 has exactly zero gradient: every objective's policy-gradient
        term is a multiple of A, the entropy bonus and the KL term are not."""
        return self.entropy_coef == 0.0 and self.entropy_target is None and self.beta == 0.0

    @property
    def skips_zero_advantage(self) -> bool:
        """Whether sequences with advantage 0 are left out of the update (train.skip_zero_advantage)."""
        return self.zero_advantage_no_gradient if self.skip_zero_advantage is None else self.skip_zero_advantage

    @property
    def drops_truncated(self) -> bool:
        """loss.overlong=mask, DAPO's overlong filtering: a response cut at L_max leaves the loss and its
        denominators, as if never sampled."""
        return self.overlong == "mask"

    @property
    def penalizes_length(self) -> bool:
        """loss.overlong=soft_penalty: DAPO's R_len is added to every response's reward."""
        return self.overlong == "soft_penalty"

    @property
    def needs_reference(self) -> bool:
        """The KL term needs the reference policy's log-probs."""
        return self.beta > 0

    def trains(self, advantage: float, weight: float, truncated: bool) -> bool:
        """Whether a sequence is worth a forward and backward: gate M != 0 (a gated-out sequence adds
        nothing), advantage != 0 where `skips_zero_advantage`, not cut where `drops_truncated`."""
        if weight == 0.0 or (self.drops_truncated and truncated):
            return False
        return not (self.skips_zero_advantage and advantage == 0.0)

    def carries_signal(self, advantage: float) -> bool:
        """Whether a trained sequence's gradient can be non-zero (the update's work counts)."""
        return advantage != 0.0 or not self.zero_advantage_no_gradient

    def denominator(self, sequences: int, tokens: int) -> float:
        """`loss_denominator` of an update batch of `sequences` counted sequences and `tokens` response tokens."""
        return loss_denominator(self.agg, sequences, tokens, self.max_tokens)

    def entropy_denominator(self, sequences: int, tokens: int) -> float:
        """The bonus's denominator for the update batch: the loss's, or its token count under token_mean."""
        if self.entropy_agg == "token_mean":
            return loss_denominator("token_mean", sequences, tokens, self.max_tokens)
        return self.denominator(sequences, tokens)

    def length_penalty(self, lengths: Tensor) -> Tensor:
        """[b, G] response token counts -> R_len [b, G] (DAPO eq. 13) under soft_penalty, else zeros."""
        if not self.penalizes_length:
            return torch.zeros(lengths.shape)
        return overlong_penalty(lengths, self.max_tokens, self.overlong_buffer, self.overlong_penalty)


AGREEMENT = ("logprob_diff", "logprob_gap", "logprob_tokens")


def engine_agreement(old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs are from the policy's on the tokens of `mask`: logprob_diff (sum of
    |log pi_old - log pi_engine|), logprob_gap (sum of log pi_engine - log pi_old), logprob_tokens."""
    return {
        "logprob_diff": torch.where(mask, (old - engine).abs(), 0.0).sum(),
        "logprob_gap": torch.where(mask, engine - old, 0.0).sum(),
        "logprob_tokens": mask.sum(),
    }


class PolicyLoss:
    """The run's policy loss as one object: built once from its `LossSpec` and the world size, then called
    with each micro-batch's tensors (`loss_fn(logprobs, mask, advantages, weights, ...) -> (loss, sums)`).

    The rules the caller would otherwise decide live here: which sequences the denominators count
    (`counts`), pi_old when no earlier update moved the weights (the on-policy rule), the rollout importance
    weights (`loss.rollout_is` as run), and the denominators over the world size.
    """

    def __init__(self, spec: LossSpec, world: int = 1, *, on_gpu: bool = False):
        self.spec, self.world = spec, world
        self.rollout_is = resolve_mode(spec.rollout_is, on_gpu)  # "off" or the mode that runs

    def counts(self, lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, int]:
        """The sequences and response tokens (`lengths`, one per sequence) of an update batch that its loss
        denominators count (`LossSpec.denominator`): all of them, gated ones included, except truncated ones
        under loss.overlong=mask (DAPO's overlong filtering: a cut response is treated as never sampled, so
        it leaves the token_mean denominator, the seq_mean count and dr_grpo's N alike, not only the
        numerator)."""
        kept = [n for n, cut in zip(lengths, truncated, strict=True) if not (self.spec.drops_truncated and cut)]
        return {"sequences": len(kept), "tokens": sum(kept)}

    def __call__(
        self,
        logprobs: Tensor,
        mask: Tensor,
        advantages: Tensor,
        weights: Tensor,
        *,
        counts: dict[str, float],
        old_logprobs: Tensor | None = None,
        engine_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        entropy: Tensor | None = None,
        entropy_coef: float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor | float]]:
        """One micro-batch's loss, to be backpropagated, and its statistics as sums over its tokens.

        logprobs (pi_theta, with gradient), mask (the response tokens), old_logprobs, engine_logprobs (the sampler's),
        ref_logprobs, entropy: [N, L]; advantages, weights (the gate M): [N]. counts: the whole update
        batch's "sequences" and "tokens" on all ranks (`counts`, summed), for the denominators.
        old_logprobs None: one update per rollout batch, on-policy, pi_old = pi_theta (the paper's setting).
        entropy_coef: the bonus's weight this step (loss.entropy_target's adaptive coefficient); None: the
        spec's.

        Returns (loss, sums): loss, pg_loss; trained_tokens; entropy, clip_frac, kl_ref weighted by tokens;
        kl_tokens; logprob_diff (sum |pi_old - pi_engine| over tokens), logprob_gap (sum of
        pi_engine - pi_old), logprob_tokens; is_weight, is_capped, is_masked (token-weighted), is_masked_seqs,
        is_seqs, is_tokens (`trapo.algorithm.importance.rollout_is_weights`).
        """
        s, mask = self.spec, mask.bool()
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        is_weights, is_metrics = None, {}
        if engine_logprobs is not None and self.rollout_is != "off":
            is_weights, is_metrics = rollout_is_weights(
                old, engine_logprobs, mask, mode=self.rollout_is, cap=s.rollout_is_cap, lower=s.rollout_is_lower
            )
        sequences, tokens = int(counts["sequences"]), int(counts["tokens"])
        loss, metrics = policy_loss(
            logprobs,
            old,
            advantages,
            mask,
            clip_eps=s.clip_eps,
            clip_eps_high=s.clip_eps_high,
            objective=s.objective,
            weights=weights,
            agg=s.agg,
            # Divided by the world size because DeepSpeed averages gradients over ranks.
            denom=s.denominator(sequences, tokens) / self.world,
            entropy=entropy,
            entropy_coef=s.entropy_coef if entropy_coef is None else entropy_coef,
            entropy_agg=s.entropy_agg,
            entropy_denom=s.entropy_denominator(sequences, tokens) / self.world,
            token_weights=is_weights,
            ref_logprobs=ref_logprobs,
            beta=s.beta,
        )
        n, engine = mask.sum(), engine_logprobs
        return loss, {
            "loss": loss.detach(),
            "pg_loss": metrics["pg_loss"],
            "entropy": metrics.get("entropy", 0.0) * n,
            "clip_frac": metrics["clip_frac"] * n,
            "trained_tokens": n,
            **(engine_agreement(old, engine, mask) if engine is not None else dict.fromkeys(AGREEMENT, 0.0)),
            "is_weight": is_metrics.get("is_weight_mean", 0.0) * n,
            "is_capped": is_metrics.get("is_capped_frac", 0.0) * n,
            "is_tokens": n if is_weights is not None else 0.0,
            "is_masked": is_metrics.get("is_masked_frac", 0.0) * n,
            "is_masked_seqs": is_metrics.get("is_masked_seqs", 0.0),
            "is_seqs": is_metrics.get("is_seqs", 0.0),
            "kl_ref": metrics.get("kl_ref", 0.0) * n,
            "kl_tokens": n if "kl_ref" in metrics else 0.0,
        }
