"""One step's policy update: shaped rewards -> group advantages -> training sequences -> update batches
-> one optimizer step per update batch (`Policy.update`).

    applied, sums, n_updates, work = update_policy(policy, cfg, step, prompts, labeled, rollouts, rewards,
                                                   gate, update_of, n_updates)

The rank's kept groups arrive with their update batch (`trapo.training.sampling.update_plan`), so every rank runs
the same number of optimizer steps. Collective: every rank calls it, maybe with no groups.
"""

from __future__ import annotations

import torch

from trapo.algorithm.loss import group_advantages, overlong_penalty
from trapo.config import Config
from trapo.engine import dist
from trapo.engine.batch import build_sequences, loss_counts
from trapo.engine.policy import UPDATE_SUMS, Policy


def shaped_advantages(
    rewards: list[list[float]], lengths: list[list[int]], cfg: Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group advantages (paper eq. "advantage") of the rewards plus DAPO's soft overlong penalty when
    loss.overlong is soft_penalty (rewards only: pass rates never see it).

    rewards, lengths: [b][G] (b may be 0) -> (advantages [b, G], penalty [b, G])."""
    lo, max_tokens, g = cfg.loss, cfg.rollout.max_tokens, cfg.rollout.n
    lengths_t = torch.tensor(lengths).reshape(len(lengths), g)  # [b, G]
    penalty = torch.zeros(lengths_t.shape)
    if lo.overlong == "soft_penalty":
        penalty = overlong_penalty(lengths_t, max_tokens, lo.overlong_buffer_tokens(max_tokens), lo.overlong_penalty)
    rewards_t = torch.tensor(rewards, dtype=torch.float32).reshape(len(rewards), g)  # [b, G]
    return group_advantages(rewards_t + penalty, lo.advantage_scale), penalty


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
    step: int,
    prompts: list[list[int]],
    labeled: list[bool],
    rollouts: list[list],
    rewards: list[list[float]],
    gate: list[float],
    update_of: list[int],
    n_updates: int,
) -> tuple[bool, dict[str, float], int, dict[str, int]]:
    """Optimizer steps over this rank's kept groups, in update batches.

    prompts, labeled, gate, update_of: [b] per kept group (update_of: its update batch, of n_updates on
    every rank); rollouts, rewards: [b][G]. Returns (every update applied, this rank's UPDATE_SUMS added
    over updates, number of updates, the updates' work counts over all ranks for
    `packing.update_efficiency`).
    """
    g, drop_truncated = cfg.rollout.n, cfg.loss.overlong == "mask"
    advantages, penalty = shaped_advantages(rewards, [[len(r.token_ids) for r in group] for group in rollouts], cfg)
    seqs = build_sequences(
        prompts=prompts,
        responses=[[r.token_ids for r in group] for group in rollouts],
        advantages=advantages.tolist(),
        gate=gate,
        labeled=labeled,
        engine_logprobs=[[r.logprobs for r in group] for group in rollouts],
        truncated=[[r.truncated for r in group] for group in rollouts],
    )  # [b * G], question-major
    parts = [[] for _ in range(n_updates)]  # [updates][...]
    for q, u in enumerate(update_of):
        parts[u] += seqs[q * g : (q + 1) * g]
    # Loss denominators count the whole update batch on all ranks, gated and skipped sequences included.
    batches = [dist.all_sum(loss_counts(p, drop_truncated=drop_truncated)) for p in parts]
    parts = [policy.trainable(p) for p in parts]  # no compute for sequences that add nothing
    if cfg.train.balance_ranks:  # near-equal tokens per rank: no rank waits on a busier one
        parts = [policy.balance(p) for p in parts]
    if len(parts) > 1:  # several updates: the later ones need pi_old from before the first
        parts = resplit(policy.with_logprobs([s for p in parts for s in p], "old_logprobs"), parts)
    if cfg.loss.beta > 0:  # the KL term's reference: the initial weights
        parts = resplit(policy.with_logprobs([s for p in parts for s in p], "ref_logprobs"), parts)
    applied, sums, work = True, dict.fromkeys(UPDATE_SUMS, 0.0), {}
    if cfg.loss.overlong == "soft_penalty":
        sums.update(overlong_penalty=float(penalty.sum()), overlong_responses=float(penalty.numel()))
    for part, batch in zip(parts, batches):
        ok, part_sums, part_work = policy.update(part, step, batch)
        applied &= ok
        sums = {name: sums[name] + part_sums[name] for name in UPDATE_SUMS}
        work = {name: work.get(name, 0) + n for name, n in part_work.items()}
    return applied, sums, len(parts), work
