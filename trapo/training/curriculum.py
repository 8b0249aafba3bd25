"""The curriculum in the loop (`sampling.curriculum`): an epoch's batches and what metrics.jsonl says of it.

The rule is `trapo.algorithm.curriculum`; here it meets the data order. An epoch under the curriculum is
one pass over the questions the plan admits: the (seed, epoch) permutation of `trapo.data.epoch_batches`
with the skipped questions taken out, except the first skipped ones in it that top the last batch up, so
every batch is full and the epoch has fewer of them. The plan is read from the tracker, which changes only
at epoch ends: any step of an epoch, before or after a resume, computes the same batches.
"""

from __future__ import annotations

import torch

from trapo.algorithm.curriculum import EpochPlan, plan_epoch, readmission_outcome
from trapo.algorithm.passrate import PassRateTracker
from trapo.config import Config
from trapo.data import epoch_batches


def _rule(cfg: Config, tracker: PassRateTracker) -> dict:
    """What the rule reads: the tracker's trajectories and the run's curriculum settings."""
    c = cfg.sampling
    return dict(
        trajectories=tracker.trajectories,
        observed=tracker.observed,
        labeled=tracker.labeled,
        window=c.curriculum_window,
        readmit_every=c.curriculum_readmit_every,
        min_admitted=cfg.train.rollout_batch_size,
    )


def epoch_order(cfg: Config, tracker: PassRateTracker, epoch: int) -> tuple[list[list[int]], EpochPlan | None]:
    """The epoch's batches (question indices) and its plan; without a curriculum today's order and None."""
    t, q = cfg.train, tracker.num_questions
    if cfg.sampling.curriculum == "none":
        return epoch_batches(q, t.rollout_batch_size, t.update_batch_size, cfg.seed, epoch), None
    plan = plan_epoch(**_rule(cfg, tracker))
    admitted = plan.admitted.tolist()
    return epoch_batches(q, t.rollout_batch_size, t.update_batch_size, cfg.seed, epoch, admitted), plan


def step_values(plan: EpochPlan, order: list[list[int]], labeled: torch.Tensor) -> dict[str, int]:
    """metrics.jsonl's `curriculum` block on every step of an epoch: questions left out of the epoch's batches
    (labeled, unlabeled: the rule skips none), saturated ones rolled out as the every-m-th epoch's check
    (readmitted) or to fill the last batch (topped_up), and the epoch's batches."""
    used = torch.zeros_like(plan.skipped)
    used[[i for batch in order for i in batch]] = True
    left_out = plan.skipped & ~used
    return {
        "skipped_labeled": int((left_out & labeled).sum()),
        "skipped_unlabeled": int((left_out & ~labeled).sum()),
        "readmitted": int(plan.readmitted.sum()),
        "topped_up": int((plan.skipped & used).sum()),
        "epoch_batches": len(order),
    }


def epoch_end_values(cfg: Config, tracker: PassRateTracker) -> dict[str, int]:
    """After the tracker closed an epoch: how its re-admitted questions did (forgotten: solved before, now not)."""
    return readmission_outcome(**_rule(cfg, tracker))
