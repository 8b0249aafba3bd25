"""One step's policy update: shaped rewards -> group advantages -> training sequences -> update batches
-> one optimizer step per update batch (`Policy.update`), by the loss the policy calls (`Policy.loss`, a
`PolicyLoss`).

    result = update_policy(policy, cfg, kept, prompts, labeled, step=step, n_updates=n_updates)

The rank's kept groups arrive with their update batch (`trapo.training.sampling.update_plan`), so every rank runs
the same number of optimizer steps. Collective: every rank calls it, maybe with no groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trapo.algorithm.loss import LossSpec, group_advantages
from trapo.config import Config
from trapo.engine import dist
from trapo.engine.batch import build_sequences
from trapo.engine.policy import UPDATE_SUMS, Policy
from trapo.training.sampling import KeptGroups


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
) -> UpdateResult:
    """Optimizer steps over this rank's kept groups, in the `n_updates` update batches that `kept.update_of`
    indexes (as many on every rank). prompts, labeled: [k], one per kept group. entropy_coef: the adaptive
    coefficient (loss.entropy_target), else None."""
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
    result = UpdateResult(applied=True, sums=dict.fromkeys(UPDATE_SUMS, 0.0), work={})
    if spec.penalizes_length:
        result.sums.update(overlong_penalty=float(penalty.sum()), overlong_responses=float(penalty.numel()))
    for part, batch in zip(parts, batches):
        ok, part_sums, part_work = policy.update(part, step, batch, entropy_coef)
        result.applied &= ok
        result.sums = {name: result.sums[name] + part_sums[name] for name in UPDATE_SUMS}
        result.work = {name: result.work.get(name, 0) + n for name, n in part_work.items()}
    return result
