"""Work layout of the policy update: padding-free packed micro-batches, token-balanced ranks, efficiency.

Pure functions (no model, no distributed calls); `trapo.engine.policy` runs them.

- `pack_rows` groups sequences into micro-batches of at most `budget` tokens *without* padding, and
  `collate_packed` concatenates one micro-batch into a single row whose `position_ids` restart at 0 for
  every sequence, with the sequences' offsets (`packed_bounds`). The registered attention
  (`varlen_attention`) reads those offsets: on a GPU torch's varlen flash-attention kernel runs the pack in
  one call, elsewhere sdpa runs once per sequence; no token attends across sequences and no [S, S] mask
  exists. The loss still sees the padded `[b, T-1]` layout: the packed row's response positions come out
  in the same order as the padded mask's, and are scattered back to it.
- `balance` assigns the update batch's sequences to ranks so each rank's token count is nearly equal
  (longest first onto the least-loaded rank, ties by position: the same answer on every rank).
- `update_efficiency` measures the update's useful share: tokens that carry signal over tokens computed
  by all ranks, where ZeRO-3 makes every rank wait for the busiest rank's micro-batch at each slot.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from trapo.engine.batch import TrainSequence, collate


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


ATTENTION = "trapo_varlen"  # the attention implementation registered for packed rows (`register_attention`)
# Which kernel packed rows ran, and why not the varlen one (read by the GPU check and bench_update_gpu).
KERNEL = {"name": "sdpa per sequence", "why": "not tried: no packed row on a GPU yet"}
_VARLEN_OK: dict[tuple, bool] = {}  # (device, dtype, heads, kv_heads, head_dim) -> the self-check's verdict


def _per_sequence(module, query, key, value, bounds, **kw) -> Tensor:
    """transformers' sdpa kernel once per packed sequence: [1, S, heads, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    parts = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kw)[
            0
        ]
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=1)


def _varlen(query: Tensor, key: Tensor, value: Tensor, bounds: list[int], scaling: float | None) -> Tensor:
    """torch's varlen flash attention (torch.nn.attention.varlen, CUDA) over the whole pack: [1, S, heads, d].

    Causal within each sequence by `cu_seqlens`; no [S, S] mask and no per-sequence launches. Key-value
    heads are repeated for grouped-query attention where the kernel has no `enable_gqa`."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, heads, d]
    causal, gqa = _varlen_keywords()
    kw = {"scale": scaling, **causal}
    if q.shape[1] != k.shape[1]:
        if gqa:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    cu, longest = _cu_seqlens(tuple(bounds), str(q.device))
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw).unsqueeze(0)


@functools.cache
def _varlen_keywords() -> tuple[dict, bool]:
    """(how this torch's varlen_attn asks for causal attention, whether it takes enable_gqa), read once."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return ({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}), "enable_gqa" in params


@functools.lru_cache(maxsize=8)
def _cu_seqlens(bounds: tuple[int, ...], device: str) -> tuple[Tensor, int]:
    """The pack's cumulative offsets on the device and its longest sequence: built once per micro-batch (every
    layer reads the same; a host-to-device copy per layer would synchronise each one)."""
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return torch.tensor(bounds, dtype=torch.int32, device=device), longest


def _varlen_works(module, query: Tensor, key: Tensor, scaling: float | None, **kw) -> bool:
    """Once per (device, dtype, head layout): the varlen kernel's output and gradients on a small random pack
    against the per-sequence path. A kernel that is missing, fails, or differs is not used (KERNEL says why)."""
    sig = (str(query.device), query.dtype, query.shape[1], key.shape[1], query.shape[-1])
    if sig not in _VARLEN_OK:
        try:
            gen = torch.Generator(device=query.device).manual_seed(0)
            bounds = [0, 5, 12, 20]
            q, k, v = (torch.randn((1, h, 20, sig[4]), generator=gen, device=query.device, dtype=query.dtype,
                                   requires_grad=True) for h in (sig[2], sig[3], sig[3]))  # fmt: skip
            ours = _varlen(q, k, v, bounds, scaling)
            ref = _per_sequence(module, q, k, v, bounds, scaling=scaling, **kw)
            grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in (ours, ref)]
            worst = max(float((a.float() - b.float()).abs().max()) for a, b in [(ours, ref), *zip(*grads)])
            _VARLEN_OK[sig] = worst < 5e-2
            KERNEL.update(why="" if _VARLEN_OK[sig] else f"differs from sdpa by {worst:.3g} on a check pack")
        except Exception as err:  # noqa: BLE001 - no such kernel in this torch, or not for this GPU or dtype
            _VARLEN_OK[sig] = False
            KERNEL.update(why=f"{type(err).__name__}: {str(err)[:120]}")
    return _VARLEN_OK[sig]


def varlen_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, packed_bounds=None, **kw):
    """Causal attention within each packed sequence, never across: a [S, S] mask is never built.

    query: [1, heads, S, d]; key, value: [1, kv_heads, S, d]; packed_bounds: the sequences' start offsets
    and S, as a list (no device sync per layer). On a GPU with bf16/fp16, torch's varlen flash-attention
    kernel runs the whole pack in one call (after a one-time self-check against the per-sequence path);
    elsewhere transformers' sdpa kernel runs once per sequence. Without bounds (one sequence per row,
    right-padded), plain causal attention is exact for every real token.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kw.get("sliding_window"):
        raise ValueError("packed micro-batches do not support sliding-window attention; set train.packing=false")
    kw.pop("is_causal", None)
    if packed_bounds is None:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kw)
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not kw.get("dropout"):
        scaling = kw.pop("scaling", None)
        if _varlen_works(module, query, key, scaling, **kw):
            KERNEL["name"] = "torch varlen_attn (flash attention over cu_seqlens)"
            return _varlen(query, key, value, packed_bounds, scaling), None
        kw["scaling"] = scaling
    KERNEL["name"] = "sdpa per sequence"
    return _per_sequence(module, query, key, value, packed_bounds, **kw), None  # [1, S, heads, d]


def register_attention() -> str:
    """Make `ATTENTION` a transformers attention implementation (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    return ATTENTION
