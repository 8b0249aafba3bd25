"""One step's policy update: shaped rewards -> group advantages -> training sequences -> update batches
-> one optimizer step per update batch (`Policy.update`), by the loss the policy calls (`Policy.loss`, a
`PolicyLoss`).

    result = update_policy(policy, cfg, kept, prompts, labeled, step=step, n_updates=n_updates, answers=answers)

When no rank trains a sequence that carries the engine's log-probs (every reward equal: exactly what a corrupted
weight push causes), `probe_sequences` of the step's answers are scored by the policy without gradient, so the
rollout engine's health (logprob_diff_rollout_vs_policy) is measured every step all the same.

The rank's kept groups arrive with their update batch (`trapo.training.sampling.update_plan`), so every rank runs
the same number of optimizer steps. Collective: every rank calls it, maybe with no groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trapo.algorithm.loss import AGREEMENT, LossSpec, engine_agreement, group_advantages
from trapo.config import Config
from trapo.engine import dist
from trapo.engine.batch import TrainSequence, build_sequences
from trapo.engine.policy import UPDATE_SUMS, Policy
from trapo.training.sampling import KeptGroups

PROBE_SEQUENCES = 4  # per rank: answers scored for the engine's health when the update trains none


@dataclass
class UpdateResult:
    """What a step's updates did."""

    applied: bool  # every update applied (False: a non-finite loss on some rank made DeepSpeed skip one)
    sums: dict[str, float]  # this rank's UPDATE_SUMS, added over the updates
    work: dict[str, int]  # the updates' work counts over all ranks, for `packing.update_efficiency`


def shaped_advantages(
    rewards: list[list[float]], lengths: list[list[int]], loss: LossSpec, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group advantages (paper eq. "advantage") of the rewards plus DAPO's soft overlong penalty when
    loss.overlong is soft_penalty (rewards only: pass rates never see it).

    rewards, lengths: [b][G] (b may be 0, G = group_size) -> (advantages [b, G], penalty [b, G])."""
    penalty = loss.length_penalty(torch.tensor(lengths).reshape(len(lengths), group_size))  # [b, G]
    rewards_t = torch.tensor(rewards, dtype=torch.float32).reshape(len(rewards), group_size)  # [b, G]
    return group_advantages(rewards_t + penalty, loss.advantage_scale), penalty


def resplit(flat: list, parts: list[list]) -> list[list]:
    """`flat` cut into lists of the lengths of `parts`."""
    out, start = [], 0
    for p in parts:
        out.append(flat[start : start + len(p)])
        start += len(p)
    return out


def update_policy(
    policy: Policy,
    cfg: Config,
    kept: KeptGroups,
    prompts: list[list[int]],
    labeled: list[bool],
    *,
    step: int,
    n_updates: int,
    entropy_coef: float | None = None,
    answers: tuple[list[list[int]], list[list]] | None = None,
) -> UpdateResult:
    """Optimizer steps over this rank's kept groups, in the `n_updates` update batches that `kept.update_of`
    indexes (as many on every rank). prompts, labeled: [k], one per kept group. entropy_coef: the adaptive
    coefficient (loss.entropy_target), else None. answers: (prompts [b], rollouts [b][G]) of this rank's
    answers in the step, for `probe_sequences` when nothing trained carries the engine's log-probs (default:
    the kept groups)."""
    spec, g = policy.loss.spec, cfg.rollout.n
    lengths = [[len(r.token_ids) for r in group] for group in kept.rollouts]
    advantages, penalty = shaped_advantages(kept.rewards, lengths, spec, g)
    seqs = build_sequences(
        prompts=prompts,
        responses=[[r.token_ids for r in group] for group in kept.rollouts],
        advantages=advantages.tolist(),
        gate=kept.gate,
        labeled=labeled,
        engine_logprobs=[[r.logprobs for r in group] for group in kept.rollouts],
        truncated=[[r.truncated for r in group] for group in kept.rollouts],
    )  # [k * G], question-major
    parts = [[] for _ in range(n_updates)]  # [updates][...]
    for q, u in enumerate(kept.update_of):
        parts[u] += seqs[q * g : (q + 1) * g]
    # Loss denominators count the whole update batch on all ranks, gated and skipped sequences included.
    batches = [
        dist.all_sum(policy.loss.counts([len(s.ids) - s.prompt_len for s in p], [s.truncated for s in p]))
        for p in parts
    ]
    parts = [policy.trainable(p) for p in parts]  # no compute for sequences that add nothing
    if cfg.train.balance_ranks:  # near-equal tokens per rank: no rank waits on a busier one
        parts = [policy.balance(p) for p in parts]
    if len(parts) > 1:  # several updates: the later ones need pi_old from before the first
        parts = resplit(policy.with_logprobs([s for p in parts for s in p], "old_logprobs"), parts)
    if spec.needs_reference:  # the KL term's reference: the initial weights
        parts = resplit(policy.with_logprobs([s for p in parts for s in p], "ref_logprobs"), parts)
    # Nothing trained carries the engine's log-probs on any rank (decided alike: a forward is collective): its
    # health from a probe, scored before the optimizer step moves the weights; steps that train are untouched.
    probed = {}
    if not dist.all_max(int(any(s.engine_logprobs is not None for p in parts for s in p))):
        probed = engine_health(policy, probe_sequences(*(answers or (prompts, kept.rollouts))))
    result = UpdateResult(applied=True, sums=dict.fromkeys(UPDATE_SUMS, 0.0), work={})
    if spec.penalizes_length:
        result.sums.update(overlong_penalty=float(penalty.sum()), overlong_responses=float(penalty.numel()))
    for part, batch in zip(parts, batches):
        ok, part_sums, part_work = policy.update(part, step, batch, entropy_coef)
        result.applied &= ok
        result.sums = {name: result.sums[name] + part_sums[name] for name in UPDATE_SUMS}
        result.work = {name: result.work.get(name, 0) + n for name, n in part_work.items()}
    result.sums.update(probed)
    return result


def probe_sequences(prompts: list[list[int]], rollouts: list[list], k: int = PROBE_SEQUENCES) -> list[TrainSequence]:
    """A fixed share of this rank's answers with the engine's log-probs: min(k, all), evenly spaced in
    question-major order (no random draw: runs stay reproducible). prompts: [b]; rollouts: [b][G]."""
    flat = [(p, r) for p, group in zip(prompts, rollouts) for r in group if r.logprobs is not None and r.token_ids]
    picks = [flat[i * len(flat) // k] for i in range(min(k, len(flat)))]
    return build_sequences(
        prompts=[p for p, _ in picks],
        responses=[[r.token_ids] for _, r in picks],
        advantages=[[0.0] for _ in picks],
        gate=[0.0 for _ in picks],
        labeled=[True for _ in picks],
        engine_logprobs=[[r.logprobs] for _, r in picks],
        truncated=[[r.truncated] for _, r in picks],
    )


def engine_health(policy: Policy, seqs: list[TrainSequence]) -> dict[str, float]:
    """The update's comparison of the policy's log-probs with the engine's (`PolicyLoss`: logprob_diff,
    logprob_gap, logprob_tokens) on `seqs`, scored without gradient. Collective: every rank calls it, maybe
    with no sequences."""
    sums = dict.fromkeys(AGREEMENT, 0.0)
    for s in policy.with_logprobs(seqs, "old_logprobs"):
        old = torch.tensor(s.old_logprobs, dtype=torch.float32)  # [L]
        engine = torch.tensor(s.engine_logprobs, dtype=torch.float32)  # [L]
        for name, value in engine_agreement(old, engine, torch.ones_like(old, dtype=torch.bool)).items():
            sums[name] += float(value)
    return sums
