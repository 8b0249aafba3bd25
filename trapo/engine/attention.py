"""Attention for packed rows: causal within each packed sequence, never across, with no [S, S] mask.

The kernel is chosen once per (device, dtype, head layout), before the first training forward, by
`choose_kernel`: on a CUDA GPU in bf16/fp16, torch's varlen flash attention (one call over the whole pack)
if it passes a self-check against plain per-sequence attention on a small random pack, outputs and
gradients; otherwise transformers' sdpa once per sequence. The choice is made outside the model: a check
run inside a forward would be counted by non-reentrant gradient checkpointing in the forward and not in its
recompute (a `CheckpointError` at the backward), and under `no_grad` its gradients cannot be computed.

`varlen_attention` (registered as transformers attention `ATTENTION`) only reads the choice. A stand-in
kernel with `varlen_kernel`'s signature can be passed to `choose_kernel` (the CPU tests do).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

ATTENTION = "trapo_varlen"  # the attention implementation registered for packed rows (`register_attention`)
PER_SEQUENCE = "sdpa per sequence"
VARLEN = "torch varlen_attn (flash attention over cu_seqlens)"
# Which kernel packed rows last ran, and why not the one-call kernel (read by the GPU check and bench_update_gpu).
KERNEL = {"name": PER_SEQUENCE, "why": "no kernel chosen yet (attention.choose_kernel)"}
CHECK_BOUNDS = [0, 5, 12, 20]  # the self-check's pack: three sequences of 5, 7 and 8 tokens
CHECK_ULPS = 16  # a kernel may differ from the reference by this many of the dtype's epsilon, relative


@dataclass(frozen=True)
class Choice:
    """The kernel packed rows run for one (device, dtype, heads, kv_heads, head_dim); `kernel` None: per sequence."""

    name: str
    kernel: Callable | None
    why: str  # why the one-call kernel is not used ("" when it is)


_CHOSEN: dict[tuple, Choice] = {}


def signature(device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> tuple:
    return (torch.device(device).type, dtype, heads, kv_heads, head_dim)


def head_layout(model_config) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) of a transformers decoder config."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return heads, kv_heads, head_dim


def varlen_kernel(query: Tensor, key: Tensor, value: Tensor, bounds: list[int], scaling: float | None) -> Tensor:
    """torch's varlen flash attention (torch.nn.attention.varlen, CUDA) over the whole pack: [1, S, heads, d].

    query: [1, heads, S, d]; key, value: [1, kv_heads, S, d]. Causal within each sequence by `cu_seqlens`.
    Key-value heads are repeated for grouped-query attention where the kernel has no `enable_gqa`."""
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


def reference_attention(query: Tensor, key: Tensor, value: Tensor, bounds: list[int], scaling: float | None) -> Tensor:
    """Plain causal attention on each sequence alone (what a packed kernel must equal): [1, S, heads, d]."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scaling
        )
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def self_check(kernel: Callable, sig: tuple, device) -> str:
    """ "" if `kernel` matches `reference_attention` on a small random pack, outputs and the gradients of q, k
    and v, within CHECK_ULPS of the dtype's epsilon relative to each tensor's largest entry; else why not.

    Runs under `enable_grad` whatever the caller's mode, never inside a model's forward."""
    _, dtype, heads, kv_heads, head_dim = sig
    with torch.enable_grad():
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn((1, h, CHECK_BOUNDS[-1], head_dim), generator=gen, device=device, dtype=dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)
        )
        scaling = head_dim**-0.5
        outs = [fn(q, k, v, CHECK_BOUNDS, scaling) for fn in (kernel, reference_attention)]
        if outs[0].shape != outs[1].shape:
            return f"gives shape {tuple(outs[0].shape)}, expected {tuple(outs[1].shape)}"
        grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in outs]
    for name, ours, ref in [("output", *(o.detach() for o in outs)), *zip(("dq", "dk", "dv"), *grads)]:
        scale = max(float(ref.float().abs().max()), torch.finfo(dtype).tiny)
        rel = float((ours.float() - ref.float()).abs().max()) / scale
        if not rel <= CHECK_ULPS * torch.finfo(dtype).eps:  # `not <=`: a NaN is refused too
            return f"{name} differs from per-sequence attention by {rel:.3g} relative (limit {CHECK_ULPS} eps)"
    return ""


def choose_kernel(model_config, device, dtype: torch.dtype, kernel: Callable | None = None) -> Choice:
    """Decide, once per device, dtype and head layout, which kernel packed rows run; returns the choice and logs
    why the one-call kernel is refused. `kernel`: a stand-in for torch's varlen kernel (tests); without one,
    the varlen kernel is tried on CUDA in bf16/fp16 only (its flash attention has no fp32 or CPU path)."""
    sig = signature(device, dtype, *head_layout(model_config))
    if kernel is None and sig in _CHOSEN:
        return _CHOSEN[sig]
    if kernel is None and not (sig[0] == "cuda" and dtype in (torch.bfloat16, torch.float16)):
        choice = Choice(PER_SEQUENCE, None, "the varlen kernel needs a CUDA GPU and bf16 or fp16")
    else:
        candidate = kernel or varlen_kernel
        name = VARLEN if kernel is None else getattr(kernel, "__name__", "stand-in kernel")
        try:
            why = self_check(candidate, sig, device)
        except Exception as err:  # noqa: BLE001 - no such kernel in this torch, or not for this GPU or dtype
            why = f"{type(err).__name__}: {str(err)[:160]}"
        choice = Choice(name, None, f"{name} refused: {why}") if why else Choice(name, candidate, "")
        if why:
            from trapo import console

            console.say(f"packed attention: {choice.why}; packed rows run {PER_SEQUENCE}")
    _CHOSEN[sig] = choice
    return choice


def _per_sequence(module, query, key, value, bounds, **kw) -> Tensor:
    """transformers' sdpa kernel once per packed sequence: [1, S, heads, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    parts = []
    for a, b in zip(bounds, bounds[1:]):
        out, _ = sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kw
        )
        parts.append(out)
    return torch.cat(parts, dim=1)


def varlen_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, packed_bounds=None, **kw):
    """Causal attention within each packed sequence, never across: a [S, S] mask is never built.

    query: [1, heads, S, d]; key, value: [1, kv_heads, S, d]; packed_bounds: the sequences' start offsets
    and S, as a list (no device sync per layer). Runs the kernel `choose_kernel` chose for this device,
    dtype and head layout; per-sequence sdpa where none was chosen. Without bounds (one sequence per row,
    right-padded), plain causal attention is exact for every real token.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kw.get("sliding_window"):
        raise ValueError("packed micro-batches do not support sliding-window attention; set train.packing=false")
    kw.pop("is_causal", None)
    if packed_bounds is None:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kw)
    sig = signature(query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
    choice = _CHOSEN.get(sig)
    if choice is not None and choice.kernel is not None and not kw.get("dropout"):
        KERNEL.update(name=choice.name, why="")
        return choice.kernel(query, key, value, packed_bounds, kw.get("scaling")), None
    KERNEL.update(name=PER_SEQUENCE, why=choice.why if choice else "no kernel chosen for this layout")
    return _per_sequence(module, query, key, value, packed_bounds, **kw), None  # [1, S, heads, d]


def register_attention() -> str:
    """Make `ATTENTION` a transformers attention implementation (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    return ATTENTION


def forget() -> None:
    """Drop every choice (a test that chose a stand-in kernel; the next `choose_kernel` checks again)."""
    _CHOSEN.clear()
    KERNEL.update(name=PER_SEQUENCE, why="no kernel chosen yet (attention.choose_kernel)")
