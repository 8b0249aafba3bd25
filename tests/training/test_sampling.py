"""Dynamic sampling's pure logic (trapo/training/sampling.py): filtering, the global cut, update batches, the cursor."""

import math
import random

import pytest

from trapo.data import epoch_batches
from trapo.training import sampling
from trapo.training.grading import Grades
from trapo.training.metrics import dynamic_sampling_values


def test_a_group_is_informative_when_its_rewards_differ():
    rewards = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5], [0.2, 0.2000001], []]
    assert sampling.informative(rewards) == [False, False, True, False, True, False]


def test_round_keys_name_batch_positions_as_batch_rank_world_hands_them_out():
    batch = [40, 41, 42, 43, 44, 45]  # question ids of one batch, world 2
    flags = [[True, False, True], [False, True, False]]  # rank 0 holds batch[0::2], rank 1 batch[1::2]
    keys = sampling.round_keys(3, flags)
    assert keys == [(3, 0), (3, 3), (3, 4)]
    shares = [batch[r::2] for r in range(2)]
    assert [batch[p] for _, p in keys] == [shares[0][0], shares[1][1], shares[0][2]]
    assert sampling.local_keys(3, 3, 1, 2) == [(3, 1), (3, 3), (3, 5)]


def test_cut_keeps_the_first_groups_in_round_then_position_order():
    keys = [(1, 0), (0, 7), (1, 2), (0, 1), (0, 5)]
    assert sampling.cut(keys, 4) == [(0, 1), (0, 5), (0, 7), (1, 0)]
    assert sampling.cut(keys, 10) == sorted(keys)  # fewer than the target: all of them
    assert sampling.cut(list(reversed(keys)), 4) == sampling.cut(keys, 4)  # order of arrival does not matter


@pytest.mark.parametrize(
    ("kept", "target", "rounds", "max_rounds", "left", "more"),
    [
        (10, 16, 1, 10, 3, True),
        (16, 16, 1, 10, 3, False),  # enough
        (20, 16, 2, 10, 3, False),
        (10, 16, 3, 3, 3, False),  # the round limit, the first round included
        (10, 16, 3, 0, 3, True),  # 0: no limit
        (10, 16, 1, 0, 0, False),  # the epoch's batches are used up: never crosses its end
        (0, 16, 1, 1, 5, False),  # one round: filtering only, no refill
    ],
)
def test_want_more(kept, target, rounds, max_rounds, left, more):
    assert sampling.want_more(kept, target, rounds, max_rounds, left) is more


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("update", [4, 8, 16])
def test_update_plan_with_all_groups_kept_is_todays_per_rank_split(world, update):
    """Without dynamic sampling: rank r's j-th question goes to update j // (update // world), and there are
    ceil(b_rank / (update // world)) updates, as the trainer split each rank's sequences before."""
    if update % world:
        pytest.skip("update_batch_size must be a multiple of the world size")
    for batch in epoch_batches(70, 16, world, seed=3, epoch=1):  # a short last batch too (70 = 4 * 16 + 6)
        kept = [(0, p) for p in range(len(batch))]
        for rank in range(world):
            plan, n = sampling.update_plan(kept, rank, world, update)
            share = len(batch[rank::world])
            per_rank = update // world
            assert n == math.ceil(share / per_rank)
            assert [plan[k] for k in sampling.local_keys(0, share, rank, world)] == [
                j // per_rank for j in range(share)
            ]


def test_update_plan_is_global_when_ranks_keep_unequal_numbers_of_groups():
    rng = random.Random(0)
    world, update = 4, 8
    flags = [[[rng.random() < 0.4 for _ in range(4)] for _ in range(world)] for _ in range(3)]  # 3 rounds of 16
    keys = [k for i, f in enumerate(flags) for k in sampling.round_keys(i, f)]
    kept = sampling.cut(keys, 16)
    plans = [sampling.update_plan(kept, rank, world, update) for rank in range(world)]
    per_rank = [sum(1 for k in kept if k[1] % world == r) for r in range(world)]
    assert len(set(per_rank)) > 1  # the case at hand: ranks hold different numbers of groups
    assert {n for _, n in plans} == {math.ceil(len(kept) / update)}  # every rank: the same number of updates
    merged = {k: u for plan, _ in plans for k, u in plan.items()}
    assert sorted(merged) == kept  # each kept group on exactly one rank, its owner
    assert all(k[1] % world == r for r, (plan, _) in enumerate(plans) for k in plan)
    sizes = [sum(1 for u in merged.values() if u == i) for i in range(plans[0][1])]
    assert sizes[:-1] == [update] * (len(sizes) - 1) and 0 < sizes[-1] <= update
    assert sampling.update_plan([], 0, world, update) == ({}, 1)  # nothing informative: one (empty) update


def test_take_returns_this_ranks_kept_groups_in_global_order():
    world, rank = 2, 1

    def rnd(ids):
        return sampling.Round(
            question_ids=ids,
            rollouts=[[f"r{i}"] for i in ids],
            grades=Grades([], [], []),
            gate=[float(i % 2) for i in ids],
            rewards=[[float(i)] for i in ids],
        )

    rounds = [rnd([11, 13, 15]), rnd([21, 23])]  # rank 1's shares: positions 1, 3, 5 then 1, 3
    plan = {(0, 3): 0, (1, 1): 1, (0, 0): 0, (1, 3): 1}  # (0, 0) is rank 0's
    kept = sampling.take(rounds, plan, rank, world)
    assert kept.question_ids == [13, 21, 23] and kept.rollouts == [["r13"], ["r21"], ["r23"]]
    assert kept.rewards == [[13.0], [21.0], [23.0]] and kept.gate == [1.0, 1.0, 1.0] and kept.update_of == [0, 1, 1]


def test_cursor_one_batch_per_step_is_the_step_derived_order():
    per_epoch = 4
    cursor = sampling.Cursor(0, 0)
    for step in range(13):
        assert cursor == sampling.Cursor.from_step(step, per_epoch)
        cursor = cursor.advance(1, per_epoch)


def test_cursor_refills_consume_batches_and_stop_at_the_epoch_end():
    per_epoch = 5
    assert sampling.Cursor(0, 0).advance(3, per_epoch) == sampling.Cursor(0, 3)
    assert sampling.Cursor(0, 3).advance(2, per_epoch) == sampling.Cursor(1, 0)  # used up: next epoch
    with pytest.raises(ValueError, match="6 batches used of an epoch of 5"):
        sampling.Cursor(2, 3).advance(3, per_epoch)


def test_an_epoch_of_steps_rolls_every_question_out_once():
    """The trainer's round loop, driven by random rewards: refills take the epoch's next batches, never
    cross its end, every question of the epoch is rolled out exactly once, each step keeps <= the target."""
    rng = random.Random(1)
    world, target, max_rounds = 2, 8, 3
    order = epoch_batches(51, target, world, seed=0, epoch=0)  # 6 batches of 8, one of 2; 1 question left out
    per_epoch = len(order)
    cursor, seen, steps = sampling.Cursor(0, 0), [], []
    while cursor.epoch == 0:
        first, rounds, keys = cursor.batch, 0, []
        while True:
            batch = order[first + rounds]
            seen += batch
            flags = [[rng.random() < 0.3 for _ in batch[r::world]] for r in range(world)]
            keys += sampling.round_keys(rounds, flags)
            rounds += 1
            if not sampling.want_more(len(keys), target, rounds, max_rounds, per_epoch - first - rounds):
                break
        kept = sampling.cut(keys, target)
        steps.append((rounds, len(kept)))
        cursor = cursor.advance(rounds, per_epoch)
        assert len(kept) == target or rounds == max_rounds or cursor.epoch == 1
    assert sorted(seen) == sorted(q for b in order for q in b) and len(seen) == len(set(seen)) == 50
    assert sum(r for r, _ in steps) == per_epoch and len(steps) < per_epoch  # refills made the epoch shorter


def test_dynamic_sampling_values():
    # 3 rounds of 16 groups: 48 rolled out, 20 informative, 16 kept
    assert dynamic_sampling_values(48, 20, 16, 3) == {
        "rounds": 3,
        "extra_rounds": 2,
        "groups_rolled_out": 48,
        "groups_filtered": 28,
        "groups_kept": 16,
        "groups_surplus": 4,
    }
