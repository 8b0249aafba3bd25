"""Which rolled-out groups a step trains on, and where the epoch's data cursor stands (DAPO dynamic sampling).

Dynamic sampling (DAPO, Yu et al. 2025, section "Dynamic Sampling"; `rollout.dynamic_sampling`): a group of
G rollouts whose rewards are all equal (std 0: every response right, or every one wrong) has advantage 0
for every response and gives the policy gradient nothing, so it leaves the update. When fewer informative
groups than `train.rollout_batch_size` remain (counted over all ranks), the step rolls out the NEXT batch
of the epoch's order (`trapo.data.epoch_batches`, each rank its usual share), and again, for at most
`rollout.dynamic_sampling_max_rounds` generation rounds in all (0: no limit); then the informative groups
are cut to exactly `train.rollout_batch_size` in the global order (round, position in the round's batch),
the same on every rank. Surplus informative groups are dropped, as in veRL's DAPO recipe.
The rewards compared are those the advantages are computed from (`trapo.training.grading.grade`):
0/1 correctness for labeled questions, majority agreement for unlabeled ones, or a confidence reward
(reward.unlabeled), whose continuous scores are seldom all equal. veRL's recipe filters on accuracy by
default (metric acc) and stops the run when its round limit is reached; here the step then trains on the
groups it has.

How it meets epochs and the gate:
- Refill rounds CONSUME the epoch's batches (as DAPO / veRL do): a question rolled out as a refill is not
  rolled out again later in the epoch. The trainer keeps a data `Cursor` (epoch, next batch) instead of
  deriving both from the step number, so an epoch has as many steps as it takes to use up its batches.
  A refill never crosses an epoch's end: with the epoch's batches used up, the step trains on what it has.
  With dynamic sampling off the cursor moves one batch per step, exactly the step-derived order.
- Every question rolled out, filtered or not, refill or not, gives its pass rate to the PassRateTracker
  (its trajectory must cover the epoch); the epoch's end (its last batch used) still extends the
  trajectories and selects. The gate M is the one fixed at the last epoch end, for refills too.
- Without `max_steps` a run stops after `epochs` epochs (fewer steps than epochs x batches when refills
  consume batches); with `max_steps` after that many steps (the epochs then cycle, as without dynamic
  sampling). The progress bar counts batches consumed, or steps under `max_steps`.

Ranks may keep different numbers of groups; the update batches are cut from the global order
(`update_plan`), so every rank runs the same number of optimizer steps (and `Policy` pads its micro-batches).
A group is named by its key (round, position): position p of a round's batch is rank p % world's
(p // world)-th question, as `batch[rank::world]` hands them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trapo.training.grading import Grades

Key = tuple[int, int]  # (round of the step, position in that round's batch)


@dataclass
class Round:
    """One generation round on one rank: its share of one batch, b questions."""

    question_ids: list[int]  # [b]
    rollouts: list  # [b][G] trapo.engine.rollout.Rollout
    grades: Grades
    gate: list[float]  # [b] M
    rewards: list[list[float]]  # [b][G], what the advantages are computed from


@dataclass
class KeptGroups:
    """This rank's groups that the step's update trains on, of all rounds, in global order (`take`)."""

    question_ids: list[int]  # [k]
    rollouts: list  # [k][G] trapo.engine.rollout.Rollout
    rewards: list[list[float]]  # [k][G]
    gate: list[float]  # [k] M
    update_of: list[int]  # [k] the update batch each group goes to


@dataclass(frozen=True)
class Cursor:
    """Where the next step's data starts: epoch (0-based) and batch index within the epoch's order."""

    epoch: int
    batch: int

    @classmethod
    def from_step(cls, step: int, batches_per_epoch: int) -> Cursor:
        """One batch per step: the cursor of checkpoints saved before it was kept, and of runs without refills."""
        return cls(*divmod(step, batches_per_epoch))

    def advance(self, batches: int, batches_per_epoch: int) -> Cursor:
        """After a step that used `batches` batches; the epoch's end moves on to the next epoch's first batch."""
        used = self.batch + batches
        if used > batches_per_epoch:
            raise ValueError(f"Cursor.advance: {used} batches used of an epoch of {batches_per_epoch}")
        return Cursor(self.epoch + 1, 0) if used == batches_per_epoch else Cursor(self.epoch, used)


def informative(rewards: list[list[float]]) -> list[bool]:
    """[b][G] rewards -> [b]: the group's rewards are not all equal (std > 0), so its advantages are not all 0."""
    return [len(set(group)) > 1 for group in rewards]


def round_keys(round_index: int, flags: list[list[bool]]) -> list[Key]:
    """Every rank's flags [world][b_rank] of one round -> the keys of the flagged groups, in global order."""
    world = len(flags)
    return sorted((round_index, j * world + r) for r, mine in enumerate(flags) for j, f in enumerate(mine) if f)


def want_more(kept: int, target: int, rounds: int, max_rounds: int, batches_left: int) -> bool:
    """Whether to roll out another batch: fewer than `target` informative groups over all ranks after
    `rounds` rounds, the round limit not reached (`max_rounds` 0: none) and the epoch not used up."""
    return kept < target and batches_left > 0 and (max_rounds == 0 or rounds < max_rounds)


def cut(keys: list[Key], target: int) -> list[Key]:
    """The first `target` informative groups in the global (round, position) order (every rank alike)."""
    return sorted(keys)[:target]


def update_plan(kept: list[Key], rank: int, world: int, update_size: int) -> tuple[dict[Key, int], int]:
    """The update batch of each of this rank's kept groups, and the number of update batches (>= 1).

    kept: all ranks' kept keys; update_size: groups per optimizer update (train.update_batch_size). The
    n-th group of the global order goes to update n // update_size, so the count, ceil(len / update_size),
    is the same on every rank however unevenly the groups sit. With every group of one batch kept this is
    the split by `update_size // world` groups per rank, the trainer's order without dynamic sampling.
    """
    ordered = sorted(kept)
    mine = {key: n // update_size for n, key in enumerate(ordered) if key[1] % world == rank}
    return mine, max(1, math.ceil(len(ordered) / update_size))


def local_keys(round_index: int, count: int, rank: int, world: int) -> list[Key]:
    """The keys of this rank's `count` questions of one round (its share `batch[rank::world]`)."""
    return [(round_index, j * world + rank) for j in range(count)]


def in_loss(rounds: list[Round], plan: dict[Key, int], rank: int, world: int) -> list[list[float]]:
    """[rounds][b] the gate M of this rank's groups that the update keeps, 0 for the filtered or surplus ones."""
    out = []
    for i, rnd in enumerate(rounds):
        keys = local_keys(i, len(rnd.question_ids), rank, world)
        out.append([m if key in plan else 0.0 for m, key in zip(rnd.gate, keys)])
    return out


def take(rounds: list[Round], plan: dict[Key, int], rank: int, world: int) -> KeptGroups:
    """This rank's kept groups of all rounds, in global order, as `trapo.training.update.update_policy` takes them."""
    kept = KeptGroups([], [], [], [], [])
    for i, rnd in enumerate(rounds):
        for j, key in enumerate(local_keys(i, len(rnd.question_ids), rank, world)):
            if key in plan:
                kept.question_ids.append(rnd.question_ids[j])
                kept.rollouts.append(rnd.rollouts[j])
                kept.rewards.append(rnd.rewards[j])
                kept.gate.append(rnd.gate[j])
                kept.update_of.append(plan[key])
    return kept
