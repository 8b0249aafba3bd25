"""Per-token statistics computed from a policy's logits.

Pure tensor functions shared by the loss (entropy bonus, log-probs of the
sampled tokens) and by the confidence rewards (self-certainty, entropy).
Shapes: N sequences (or N tokens for the LM-head functions), L positions,
V vocabulary entries, H hidden size, b x T a padded micro-batch.

Two entry points compute the same per-row math (`_row_stats`):
  * `token_logprobs` / `token_entropy` / `kl_uniform_to_policy` take full
    logits [N, L, V] that the caller already holds;
  * `lm_head_token_stats` takes the final hidden states of the response
    tokens [N, H] and the LM head module, and never holds more than a chunk
    of logits [chunk, V] at once, in forward or in backward (`_LeanHead`).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
from torch import Tensor

# Rows of logits computed at once by `lm_head_token_stats`. Its backward holds about
# 4 fp32 [chunk, V] tensors (0.6 GB at 256 x 152,064); smaller chunks only cost time
# (more, thinner matmuls). bench/bench_loss_memory.py measures both.
DEFAULT_CHUNK_TOKENS = 256


class TokenStats(NamedTuple):
    """Per-token statistics, each float32 [N] (None when not requested)."""

    logprobs: Tensor | None  # log p(target)
    entropy: Tensor | None  # H(p) = -sum_v p_v log p_v, nats
    kl_uniform: Tensor | None  # KL(U || p) = logsumexp(z) - mean_v(z) - log V


def _row_stats(z: Tensor, targets: Tensor | None, entropy: bool, kl_uniform: bool) -> TokenStats:
    """The statistics of softmax(z) for each row of fp32 logits z [..., V].

    targets: [...] int64 or None (then no log-prob). Every public function
    here reduces to this one, so the lean head and the full-logits path agree
    to rounding.
    """
    if not entropy and not kl_uniform:
        # Log-prob only: z[target] - logsumexp(z) keeps no [..., V] log-softmax
        # alive for backward beyond z itself.
        picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
        return TokenStats(picked - torch.logsumexp(z, dim=-1), None, None)
    # log_softmax is the stable route to all three: log p = z - logsumexp(z)
    # without cancellation, and in backward it keeps only log p and p (two
    # [..., V] tensors per row block).
    logp = torch.log_softmax(z, dim=-1)  # [..., V]
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) if targets is not None else None
    ent = -(logp.exp() * logp).sum(dim=-1) if entropy else None
    # KL(U || p) = sum_v (1/V)(log(1/V) - log p_v) = -mean_v(log p_v) - log V,
    # which equals logsumexp(z) - mean_v(z) - log V.
    kl = -logp.mean(dim=-1) - math.log(z.shape[-1]) if kl_uniform else None
    return TokenStats(lp, ent, kl)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(tokens[n, l]) under softmax(logits[n, l]).

    logits: [N, L, V], tokens: [N, L] (int64) -> [N, L] float32.
    Computed as z[token] - logsumexp(z): no [N, L, V] log-softmax is
    materialised, which matters at V = 150k.
    """
    return _row_stats(logits.float(), tokens, entropy=False, kl_uniform=False).logprobs


def token_entropy(logits: Tensor) -> Tensor:
    """Shannon entropy H(p) = -sum_v p_v log p_v of softmax(logits), per position.

    logits: [N, L, V] -> [N, L] float32 (nats).
    """
    return _row_stats(logits.float(), None, entropy=True, kl_uniform=False).entropy


def kl_uniform_to_policy(logits: Tensor) -> Tensor:
    """KL(U || p) per position, U the uniform distribution over V entries.

    KL(U || p) = sum_v (1/V) (log(1/V) - log p_v) = logsumexp(z) - mean_v(z) - log V.
    logits: [N, L, V] -> [N, L] float32. Zero (to rounding) when p is uniform.
    """
    return _row_stats(logits.float(), None, entropy=False, kl_uniform=True).kl_uniform


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """fp32 logits of one chunk: hidden [c, H], weight [V, H] -> [c, V]."""
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    return z.float()


def _chunk_log_probs(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, held=None) -> Tensor:
    """log p = log_softmax(z / tau) of one chunk, [c, V] fp32, computed in place in the logits' buffer.
    held: None, or (rows [c] bool, ids [S]): those rows' softmax leaves the ids out (see `lm_head_token_stats`)."""
    z = _chunk_logits(h, weight, bias)
    if temperature != 1.0:
        z.div_(temperature)
    if held is not None:
        _hold_back(z, *held, torch.finfo(z.dtype).min)
    return z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))


def _hold_back(z: Tensor, rows: Tensor, ids: Tensor, value: float) -> None:
    """z[r, ids] = value in place for each row r where rows is true. The finite fill (not -inf) gives p = 0 and
    p log p = 0 there, so the entropy stays finite."""
    z[rows.nonzero()[:, 0, None], ids[None, :]] = value


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a[i, v] * b[i, v] per row, [c], without a [c, V] product tensor."""
    return torch.bmm(a[:, None, :], b[:, :, None])[:, 0, 0]


@contextlib.contextmanager
def _tensor_cores(weight: Tensor):
    """GPU, low-precision weight: its fp32 gradient GEMM ([V, c] x [c, H], the head's largest) may use
    TF32 tensor cores. vLLM sets float32_matmul_precision("highest") for the whole process, which would
    run it on the plain fp32 units at a fraction of the speed; TF32 keeps 10 mantissa bits, more than
    the bf16 weight the gradient updates. Restored on exit; CPU and fp32 weights are left as they are."""
    if not (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class _LeanHead(torch.autograd.Function):
    """Per-token statistics of p = softmax((hidden W^T + b) / tau), a chunk of rows at a time.

    Forward saves only its inputs. Backward recomputes one chunk's log p and
    writes the gradient with respect to the tempered logits z' in place,
    from the closed forms (p_j = softmax(z')_j, t the target, H the entropy):
        d log p_t / dz'_j  = [j = t] - p_j
        d H / dz'_j        = -p_j (log p_j + H)
        d KL(U||p) / dz'_j = p_j - 1 / V
    so a chunk needs about two [chunk, V] fp32 buffers, and adds its weight
    gradient into one [V, H] buffer (per-chunk module calls with autograd would
    sum a fresh [V, H] per chunk out of place: two extra [V, H] at the peak).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, entropy, kl_uniform, held_rows, held_ids):
        columns = []
        for h, t, held in zip(hidden.split(chunk), targets.split(chunk), _held_chunks(held_rows, held_ids, chunk)):
            logp = _chunk_log_probs(h, weight, bias, temperature, held)  # [c, V]
            stats = [logp.gather(1, t[:, None])[:, 0]]
            if entropy:
                stats.append(-_row_dot(logp.exp(), logp))
            if kl_uniform:
                stats.append(-logp.mean(dim=-1) - math.log(logp.shape[-1]))
            columns.append(stats)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.options = (temperature, chunk, entropy, kl_uniform, held_rows, held_ids)
        if not columns:  # no rows: empty statistics
            return tuple(hidden.new_zeros(0, dtype=torch.float32) for _ in range(1 + entropy + kl_uniform))
        return tuple(torch.cat(column) for column in zip(*columns))

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk, entropy, kl_uniform, held_rows, held_ids = ctx.options
        g_lp = grads[0]
        g_ent = grads[1] if entropy else None
        g_kl = grads[1 + entropy] if kl_uniform else None
        # bf16 weights: their gradient is summed over chunks in fp32, then cast once
        acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if ctx.needs_input_grad[2] else None
        start = 0
        for h, t, held in zip(hidden.split(chunk), targets.split(chunk), _held_chunks(held_rows, held_ids, chunk)):
            rows = slice(start, start + h.shape[0])
            start += h.shape[0]
            dz = _chunk_logit_grad(h, weight, bias, t, temperature, g_lp, g_ent, g_kl, rows, held)  # [c, V] fp32
            if grad_hidden is not None:
                grad_hidden[rows] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                with _tensor_cores(weight):
                    grad_weight.addmm_(dz.t().to(acc), h.to(acc))
            if grad_bias is not None:
                grad_bias += dz.sum(0).to(acc)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _held_chunks(rows: Tensor | None, ids: Tensor | None, chunk: int):
    """Per chunk of rows: None (no held rows at all), or (that chunk's rows [c] bool, ids)."""
    if rows is None:
        while True:
            yield None
    yield from ((part, ids) for part in rows.split(chunk))


def _chunk_logit_grad(h, weight, bias, targets, temperature, g_lp, g_ent, g_kl, rows, held=None) -> Tensor:
    """dL / d(raw logits) of one chunk, [c, V] fp32 (see `_LeanHead`); g_*: [N] output gradients or None."""
    logp = _chunk_log_probs(h, weight, bias, temperature, held)  # [c, V]
    p = logp.exp()
    c, vocab = logp.shape
    zero = logp.new_zeros(c)
    gl = zero if g_lp is None else g_lp[rows].float()
    gk = zero if g_kl is None else g_kl[rows].float()
    if g_ent is not None:  # logp becomes -g_H (log p + H) + (g_KL - g_lp), then times p
        ent = -_row_dot(p, logp)
        dz = logp.add_(ent[:, None]).mul_(-g_ent[rows].float()[:, None]).add_((gk - gl)[:, None]).mul_(p)
    else:
        dz = p.mul_((gk - gl)[:, None])
    del p
    dz[torch.arange(c, device=dz.device), targets] += gl
    if g_kl is not None:
        dz.sub_(gk[:, None] / vocab)
    if held is not None:  # a held-back logit does not move p (the products above may overflow there)
        _hold_back(dz, *held, 0.0)
    if temperature != 1.0:
        dz.div_(temperature)  # z' = z / tau
    return dz


def _lean_forward(head: torch.nn.Module):
    plain = head.forward

    def forward(hidden: Tensor, targets: Tensor | None = None, **options):
        if targets is None:  # an ordinary call (e.g. the model's own forward): the plain Linear
            return plain(hidden)
        o = options
        return _LeanHead.apply(
            hidden,
            head.weight,
            head.bias,
            targets,
            o["temperature"],
            o["chunk"],
            o["entropy"],
            o["kl_uniform"],
            o.get("held_rows"),
            o.get("held_ids"),
        )

    return forward


def lm_head_token_stats(
    hidden: Tensor,
    head: torch.nn.Module,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy: bool = False,
    kl_uniform: bool = False,
    held_rows: Tensor | None = None,
    held_ids: Tensor | None = None,
) -> TokenStats:
    """Per-token log p(target), and optionally H(p) and KL(U || p), straight from hidden states.

    p = softmax(head(hidden) / temperature) per row (the policy at sampling
    temperature tau, as in TRL and veRL; tau = 1 is the plain softmax).
    hidden: [N, H] final hidden states of the response tokens only (already
    selected, e.g. `h[:, :-1][response_mask]`); head: the LM head, a Linear
    ([V, H] weight, optional bias); targets: [N] int64, the token each row
    predicts. Returns TokenStats of float32 [N] tensors (entropy / kl_uniform
    None unless requested).

    held_rows [N] bool and held_ids [S] int64: at those rows p is the softmax
    over the vocabulary without held_ids (their probability is 0), the
    distribution an engine samples from while its min_tokens holds the stop
    tokens back. KL(U || p) is infinite there: not computed with held rows.

    Memory: rows go through the head `chunk_tokens` at a time (`_LeanHead`):
    no [N, V] tensor exists in forward or backward, only a few [chunk, V], and
    the weight gradient is one [V, H] buffer, as for the full-logits path.
    The statistics are computed inside the head module's own call (its forward
    is extended on first use to take `targets`; a plain `head(x)` is
    unchanged), so DeepSpeed ZeRO-3's hooks gather the weight for forward and
    again before backward, as for any layer.
    """
    if hidden.dim() != 2:
        raise ValueError(f"lm_head_token_stats: hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"lm_head_token_stats: targets must be [N]=[{hidden.shape[0]}], got shape {tuple(targets.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"lm_head_token_stats: chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0.0:
        raise ValueError(f"lm_head_token_stats: temperature must be > 0, got {temperature}")
    if (held_rows is None) != (held_ids is None):
        raise ValueError("lm_head_token_stats: held_rows and held_ids go together")
    if held_rows is not None and kl_uniform:
        raise ValueError("lm_head_token_stats: KL(U || p) is infinite where tokens are held back")
    if not getattr(head, "_trapo_lean", False):
        head.forward = _lean_forward(head)
        head._trapo_lean = True
    options = dict(temperature=temperature, chunk=chunk_tokens, entropy=entropy, kl_uniform=kl_uniform)
    if held_rows is not None:
        options.update(held_rows=held_rows.bool(), held_ids=held_ids.to(device=hidden.device, dtype=torch.long))
    stats = iter(head(hidden, targets, **options))
    return TokenStats(next(stats), next(stats) if entropy else None, next(stats) if kl_uniform else None)


def scatter_to_mask(values: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """Put per-token values [N] back in a padded layout [b, L] at the positions where mask is true.

    values: [N] with N = mask.sum(), in row-major order of mask (the order of
    `x[mask]`); mask: [b, L] bool (e.g. the response mask [b, T-1]).
    Returns [b, L] of values.dtype, `fill` elsewhere; differentiable in values.
    Inverse of `out[mask]`.
    """
    mask = mask.bool()
    count = int(mask.sum())
    if values.shape != (count,):
        raise ValueError(
            f"scatter_to_mask: values must be [N]=[{count}] (true entries of mask), got {tuple(values.shape)}"
        )
    return values.new_full(mask.shape, fill).masked_scatter(mask, values)


def masked_mean(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Mean of values over positions where mask is true; 0 where none are.

    values, mask: [N, L] -> [N] for dim=-1.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum(dim=dim)
    count = mask.sum(dim=dim)
    return total / count.clamp_min(1.0)
