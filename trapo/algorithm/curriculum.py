"""Which questions an epoch skips, read from the pass-rate trajectories (`sampling.curriculum: trajectory`).

A group of G rollouts whose rewards are all equal has advantage 0 for every response and teaches nothing
(the premise of DAPO's dynamic sampling). Dynamic sampling finds such groups after generating them; the
tracker's trajectories predict them before: a labeled question solved G of G times (or failed G of G) at
each of its last k recorded epochs will most likely do so again.

The rule, for the epoch about to start, from the tracker's state at the last epoch end:
- saturated: a labeled question with at least k recorded (observed) pass rates whose last k are all 1
  ("solved") or all 0 ("failed"). Entries the tracker carried forward (the question was not rolled out
  that epoch) are not recorded and do not count.
- skipped: saturated, and rolled out within the last m - 1 epochs. So a skipped question comes back for
  one epoch every m epochs (re-admitted); if it is still saturated it leaves again, else it stays.
- nothing is skipped when the questions left would not fill one batch (`min_admitted`).

Unlabeled questions are never skipped. Their trajectories are what TCS reads, and a unanimous majority
(pass rate 1 against the pseudo-label) says the policy agrees with itself, not that it is right: on a trap
question that agreement is the error TCS exists to catch. Skipping only labeled questions leaves every
unlabeled trajectory observed; the labeled questions' carried entries (a skipped question's last recorded
rate, 1 or 0, repeated) enter the reliable database's reference as the value the question was skipped for.

The plan is a pure function of (trajectories, observed, labeled, k, m): a resume recomputes the epoch's plan
from the checkpointed tracker, which changes only at epoch ends, so no state of its own is saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class EpochPlan:
    """One epoch's curriculum: [Q] masks over the questions."""

    skipped: Tensor  # [Q] bool: left out of this epoch's batches
    readmitted: Tensor  # [Q] bool: saturated but rolled out this epoch (the every-m-th epoch's check)
    solved: Tensor  # [Q] bool: saturated at 1 (the last k recorded pass rates all 1)
    failed: Tensor  # [Q] bool: saturated at 0

    @property
    def admitted(self) -> Tensor:
        return ~self.skipped


def saturation(trajectories: Tensor, observed: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """(solved, failed), both [Q] bool: at least `window` recorded entries, the last `window` of them all 1,
    or all 0. trajectories: [Q, t] pass rates; observed: [Q, t] bool, False where the entry was carried."""
    if trajectories.shape != observed.shape:
        raise ValueError(f"saturation: trajectories {tuple(trajectories.shape)} and observed differ in shape")
    if window < 1:
        raise ValueError(f"saturation: window must be >= 1, got {window}")
    observed = observed.bool()
    later = observed.flip(1).cumsum(1).flip(1)  # [Q, t]: recorded entries from each column to the end
    last = observed & (later <= window)  # [Q, t]: the last `window` recorded entries
    enough = observed.sum(1) >= window  # [Q]
    solved = enough & ((trajectories == 1) | ~last).all(1)
    failed = enough & ((trajectories == 0) | ~last).all(1)
    return solved, failed


def epochs_since_rolled_out(observed: Tensor) -> Tensor:
    """[Q, t] bool -> [Q] long: closed epochs since the question's last recorded one (t when never)."""
    q, t = observed.shape
    if t == 0:
        return torch.zeros(q, dtype=torch.long)
    columns = torch.arange(1, t + 1).expand(q, t)  # [Q, t]
    last = torch.where(observed.bool(), columns, torch.zeros_like(columns)).amax(1)  # [Q]; 0: never
    return t - last


def plan_epoch(
    trajectories: Tensor, observed: Tensor, labeled: Tensor, window: int, readmit_every: int, min_admitted: int = 0
) -> EpochPlan:
    """The next epoch's plan from the trajectories closed so far (see the module docstring)."""
    if readmit_every < 2:
        raise ValueError(f"plan_epoch: readmit_every must be >= 2, got {readmit_every}")
    labeled = labeled.bool()
    solved, failed = saturation(trajectories, observed, window)
    solved, failed = solved & labeled, failed & labeled
    saturated = solved | failed
    due = epochs_since_rolled_out(observed) >= readmit_every - 1  # [Q]: skipped m - 1 epochs in a row
    skipped = saturated & ~due
    if int((~skipped).sum()) < min_admitted:  # the questions left would not fill a batch: skip none
        skipped = torch.zeros_like(skipped)
    return EpochPlan(skipped=skipped, readmitted=saturated & ~skipped, solved=solved, failed=failed)


def readmission_outcome(
    trajectories: Tensor, observed: Tensor, labeled: Tensor, window: int, readmit_every: int, min_admitted: int = 0
) -> dict[str, int]:
    """What the epoch just closed (the trajectories' last column) found among the questions it re-admitted:
    the plan it ran with is recomputed from the columns before. forgotten: saturated at 1, now below 1;
    unstuck: saturated at 0, now above 0; rolled out: how many re-admitted ones were recorded at all."""
    if trajectories.shape[1] == 0:
        return {"readmitted_rolled_out": 0, "readmitted_forgotten": 0, "readmitted_unstuck": 0}
    before = plan_epoch(trajectories[:, :-1], observed[:, :-1], labeled, window, readmit_every, min_admitted)
    seen = before.readmitted & observed[:, -1].bool()
    rate = trajectories[:, -1]
    return {
        "readmitted_rolled_out": int(seen.sum()),
        "readmitted_forgotten": int((seen & before.solved & (rate < 1)).sum()),
        "readmitted_unstuck": int((seen & before.failed & (rate > 0)).sum()),
    }
