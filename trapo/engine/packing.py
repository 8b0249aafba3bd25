"""Work layout of the policy update: padding-free packed micro-batches, token-balanced ranks, efficiency.

Pure functions (no model, no distributed calls); `trapo.engine.policy` runs them.

- `pack_rows` groups sequences into micro-batches of at most `budget` tokens *without* padding, and
  `collate_packed` concatenates one micro-batch into a single row whose `position_ids` restart at 0 for
  every sequence, with the sequences' offsets (`packed_bounds`). The registered attention
  (trapo/engine/attention.py) reads those offsets: no token attends across sequences and no [S, S] mask
  exists. The loss still sees the padded `[b, T-1]` layout: the packed row's response positions come out
  in the same order as the padded mask's, and are scattered back to it.
- `balance` assigns the update batch's sequences to ranks so each rank's token count is nearly equal
  (longest first onto the least-loaded rank, ties by position: the same answer on every rank).
- `update_efficiency` measures the update's useful share: tokens that carry signal over tokens computed
  by all ranks, where ZeRO-3 makes every rank wait for the busiest rank's micro-batch at each slot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trapo import console
from trapo.engine.batch import TrainSequence, collate, pack_by_tokens


def micro_batches(lengths: list[int], budget: int, packed: bool) -> list[list[int]]:
    """This rank's micro-batches (indices into `lengths`): `pack_rows` when packed, else `pack_by_tokens`.

    A sequence longer than `budget` (train.micro_batch_tokens) runs alone, over the budget: said once per
    run, with the longest sequence's tokens and the fix, since a budget chosen to bound memory then does not.
    """
    longest = max(lengths, default=0)
    if longest > budget:
        console.warn_once(
            "micro_batch_tokens",
            f"train.micro_batch_tokens={budget} is smaller than one sequence (the longest has {longest} tokens, "
            "prompt + response): each such sequence runs alone in a micro-batch of its full length, over the "
            f"budget; set train.micro_batch_tokens >= {longest}, or lower data.max_prompt_tokens / "
            "rollout.max_tokens",
        )
    return pack_rows(lengths, budget) if packed else pack_by_tokens(lengths, budget)


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into micro-batches of at most `budget` tokens in total (no padding).

    First-fit decreasing: longest first, each into the first micro-batch with room; a sequence longer
    than the budget gets one of its own. Deterministic (ties by index); covers every index once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def collate_packed(seqs: list[TrainSequence], pad_id: int) -> dict[str, Tensor]:
    """`collate`'s padded tensors (what the loss reads) plus the packed row the model runs.

    packed_ids, packed_positions: [1, S], S = total tokens, positions restarting at 0 per sequence;
    packed_response: [1, S-1], true where position t predicts a response token of the same sequence
    (never across a boundary: a sequence's last token predicts nothing).
    """
    out = collate(seqs, pad_id)
    ids, positions, response = [], [], []
    for s in seqs:
        ids += s.ids
        positions += range(len(s.ids))
        response += [False] * (s.prompt_len - 1) + [True] * (len(s.ids) - s.prompt_len) + [False]
    out["packed_ids"] = torch.tensor([ids], dtype=torch.long)  # [1, S]
    out["packed_positions"] = torch.tensor([positions], dtype=torch.long)  # [1, S]
    out["packed_response"] = torch.tensor([response[:-1]], dtype=torch.bool)  # [1, S-1]
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s.ids))
    out["packed_bounds"] = starts  # each sequence's offset, then S (a list: read by `varlen_attention`)
    return out


def balance(lengths: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Per rank, the (source rank, index) of the sequences it trains, token counts nearly equal.

    lengths: [world][n_r] token counts of each rank's sequences. Longest first onto the rank with the
    fewest tokens so far (ties: the lower rank); within a rank, the original order. Deterministic:
    every rank computes the same assignment from the same gathered lengths.
    """
    world = len(lengths)
    items = sorted(
        ((n, r, i) for r, row in enumerate(lengths) for i, n in enumerate(row)), key=lambda x: (-x[0], x[1], x[2])
    )
    load = [0] * world
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for n, r, i in items:
        dest = min(range(world), key=lambda k: (load[k], k))
        load[dest] += n
        out[dest].append((r, i))
    return [sorted(assigned) for assigned in out]


def work_counts(layouts: list[list[list[int]]], signal_tokens: int, packed: bool) -> dict[str, int]:
    """Token counts of one update's work over all ranks (add them over updates, then `update_efficiency`).

    layouts: [world][micro-batch][sequence] token counts (an empty list: a rank's filler micro-batch);
    signal_tokens: prompt + response tokens of the sequences that change the gradient, all ranks;
    packed: a micro-batch costs its token count, else b x its longest sequence (right padding).
    Every rank runs max(micro-batches) slots and a slot lasts as long as its largest micro-batch
    (ZeRO-3 gathers every layer collectively): computed = world x sum over slots of the slot's max.
    Returns signal, real (sequence tokens run), padded (real + padding) and computed.
    """
    world = len(layouts)
    slots = max((len(r) for r in layouts), default=0)

    def cost(mb: list[int]) -> int:
        return sum(mb) if packed else len(mb) * max(mb, default=0)

    costs = [[cost(r[k]) if k < len(r) else 0 for k in range(slots)] for r in layouts]
    return {
        "signal": signal_tokens,
        "real": sum(sum(mb) for r in layouts for mb in r),
        "padded": sum(map(sum, costs)),
        "computed": world * sum(max(costs[r][k] for r in range(world)) for k in range(slots)),
    }


def update_efficiency(counts: dict[str, int]) -> dict[str, float]:
    """update_efficiency = signal / computed tokens, and where the rest went: padding_share (padding
    inside micro-batches), imbalance_share (ranks waiting on a larger micro-batch, or running fillers)
    and zero_signal_share (sequences computed that cannot change the gradient). The four sum to 1."""
    computed = counts["computed"]
    if computed == 0:
        return {"update_efficiency": 1.0, "padding_share": 0.0, "imbalance_share": 0.0, "zero_signal_share": 0.0}
    return {
        "update_efficiency": counts["signal"] / computed,
        "padding_share": (counts["padded"] - counts["real"]) / computed,
        "imbalance_share": (computed - counts["padded"]) / computed,
        "zero_signal_share": (counts["real"] - counts["signal"]) / computed,
    }
