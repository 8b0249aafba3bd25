"""`model.fused_kernels`: the decoder's elementwise work in the update as compiled kernels, one per op
instead of one per tensor operation: RMSNorm (fp32 variance, scale, weight), SwiGLU (silu(gate) x up) and
rotary embedding. Each is a pure function of tensors handed to torch.compile, so it holds no parameter:
ZeRO-3's hooks still gather every weight around the module that owns it, untouched by the compiler.

Only forwards with gradients (the update) take the compiled kernels; generation and the reference model's
no-gradient forwards keep the plain ones, so no compile ever happens inside a captured decode step
(static_decoding.py). On CPU the trainer turns torch.compile off (TORCHDYNAMO_DISABLE), and the functions
below compute what transformers' modules do, in the same order of operations.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2/Llama RMSNorm: the variance in fp32, the normalized input back in its dtype, then the weight."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Kernels:
    """The three ops compiled once per process (dynamic shapes: micro-batches vary in tokens); `compile` is
    the seam a CPU test passes a tracing backend through."""

    def __init__(self, compile=None):
        compile = compile or (lambda fn: torch.compile(fn, dynamic=True))
        self.rms_norm, self.silu_mul, self.rotary = compile(rms_norm), compile(silu_mul), compile(rotary)


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _is_swiglu(module) -> bool:
    act = type(getattr(module, "act_fn", None)).__name__  # torch's SiLU or transformers' SiLUActivation
    projections = all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))
    return projections and act in ("SiLU", "SiLUActivation")


def fuse(model, kernels: Kernels) -> dict[str, int]:
    """Route `model`'s RMSNorms, SwiGLU MLPs and its attention's rotary function through `kernels` when
    gradients are on; counts of what was routed. The rotary function is swapped in the module that defines
    the attention classes (process-wide for that architecture; the plain path stays the same math)."""
    counts = {"rms_norm": 0, "swiglu": 0, "rotary": 0}
    rotary_modules = set()
    for module in model.modules():
        if _is_rms_norm(module):
            module.forward = types.MethodType(_norm_forward(kernels), module)
            counts["rms_norm"] += 1
        elif _is_swiglu(module):
            module.forward = types.MethodType(_mlp_forward(kernels), module)
            counts["swiglu"] += 1
        elif type(module).__name__.endswith("Attention"):
            rotary_modules.add(type(module).__module__)
    for name in rotary_modules:
        defining = sys.modules[name]
        plain = getattr(defining, "apply_rotary_pos_emb", None)
        if plain is None or getattr(plain, "fused_from", None) is not None:
            continue
        defining.apply_rotary_pos_emb = _rotary(kernels, plain)
        counts["rotary"] += 1
    return counts


def _norm_forward(kernels: Kernels):
    def forward(self, hidden):
        if torch.is_grad_enabled():
            return kernels.rms_norm(hidden, self.weight, self.variance_epsilon)
        return rms_norm(hidden, self.weight, self.variance_epsilon)

    return forward


def _mlp_forward(kernels: Kernels):
    def forward(self, x):
        fn = kernels.silu_mul if torch.is_grad_enabled() else silu_mul
        return self.down_proj(fn(self.gate_proj(x), self.up_proj(x)))

    return forward


def _rotary(kernels: Kernels, plain):
    def apply(q, k, cos, sin, unsqueeze_dim=1):
        if torch.is_grad_enabled():
            return kernels.rotary(q, k, cos, sin, unsqueeze_dim)
        return plain(q, k, cos, sin, unsqueeze_dim)

    apply.fused_from = plain
    return apply
