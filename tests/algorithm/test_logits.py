import math

import pytest
import torch

from trapo.algorithm.logits import (
    kl_uniform_to_policy,
    lm_head_token_stats,
    scatter_to_mask,
    token_entropy,
    token_logprobs,
)

N, H, V = 23, 8, 64


def _setup(dtype=torch.float32, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen) * 0.7)
        if bias:
            head.bias.copy_(torch.randn(V, generator=gen))
    hidden = (torch.randn(N, H, generator=gen) * 1.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=gen)
    # Random per-token coefficients so every statistic's gradient is exercised.
    coef = torch.randn(3, N, generator=gen)
    return head, hidden, targets, coef


def _naive(head, hidden, targets, temperature):
    """The trainer's old path: full logits -> .float() -> / tau -> per-position functions."""
    logits = head(hidden).float()[None] / temperature  # [1, N, V]
    return (
        token_logprobs(logits, targets[None])[0],
        token_entropy(logits)[0],
        kl_uniform_to_policy(logits)[0],
    )


def _values_and_grads(fn, head, hidden, coef):
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    lp, ent, kl = fn()
    loss = (coef[0] * lp).sum() + (coef[1] * ent).sum() + (coef[2] * kl).sum()
    loss.backward()
    return [lp.detach(), ent.detach(), kl.detach(), hidden.grad.clone(), head.weight.grad.clone()]


def _ours(head, hidden, targets, temperature, chunk):
    s = lm_head_token_stats(
        hidden, head, targets, temperature=temperature, chunk_tokens=chunk, entropy=True, kl_uniform=True
    )
    return s.logprobs, s.entropy, s.kl_uniform


@pytest.mark.parametrize("chunk", [1, 5, 8, 23, 64])  # 5 and 8 do not divide N = 23
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_lean_head_matches_naive_values_and_gradients_fp32(chunk, temperature, bias):
    head, hidden, targets, coef = _setup(bias=bias)
    want = _values_and_grads(lambda: _naive(head, hidden, targets, temperature), head, hidden, coef)
    got = _values_and_grads(lambda: _ours(head, hidden, targets, temperature, chunk), head, hidden, coef)
    for name, g, w in zip(["logprobs", "entropy", "kl", "d hidden", "d weight"], got, want):
        assert g.dtype == torch.float32
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_lean_head_logprob_only_matches_and_leaves_others_none():
    head, hidden, targets, coef = _setup()
    s = lm_head_token_stats(hidden, head, targets, chunk_tokens=4)
    assert s.entropy is None and s.kl_uniform is None
    (coef[0] * s.logprobs).sum().backward()
    got = (s.logprobs.detach(), hidden.grad.clone(), head.weight.grad.clone())
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    lp = token_logprobs(head(hidden)[None], targets[None])[0]
    (coef[0] * lp).sum().backward()
    for g, w in zip(got, (lp.detach(), hidden.grad, head.weight.grad)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_lean_head_bf16_within_bf16_tolerance():
    head, hidden, targets, coef = _setup(dtype=torch.bfloat16)
    want = _values_and_grads(lambda: _naive(head, hidden, targets, 0.7), head, hidden, coef)
    got = _values_and_grads(lambda: _ours(head, hidden, targets, 0.7, 5), head, hidden, coef)
    for name, g, w in zip(["logprobs", "entropy", "kl", "d hidden", "d weight"], got, want):
        # The statistics are fp32 from identical bf16 logits; the gradients are bf16
        # and the weight's is summed over chunks in bf16, so allow bf16 rounding.
        assert g.dtype == w.dtype, name
        scale = w.float().abs().max().item()
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * scale, msg=name)
    assert got[0].dtype == torch.float32


def test_lean_head_no_grad_path_matches_and_builds_no_graph():
    head, hidden, targets, _ = _setup()
    with torch.no_grad():
        s = lm_head_token_stats(hidden, head, targets, chunk_tokens=6, entropy=True, kl_uniform=True)
        want = _naive(head, hidden, targets, 1.0)
    assert all(x.grad_fn is None and not x.requires_grad for x in s)
    for g, w in zip(s, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_lean_head_empty_input():
    head, _, _, _ = _setup()
    hidden = torch.zeros(0, H, requires_grad=True)
    s = lm_head_token_stats(hidden, head, torch.zeros(0, dtype=torch.long), entropy=True)
    assert s.logprobs.shape == (0,) and s.entropy.shape == (0,)
    (s.logprobs.sum() + s.entropy.sum()).backward()
    assert torch.equal(head.weight.grad, torch.zeros(V, H))


def test_lean_head_rejects_bad_arguments():
    head, hidden, targets, _ = _setup()
    with pytest.raises(ValueError, match="hidden"):
        lm_head_token_stats(hidden[None], head, targets)
    with pytest.raises(ValueError, match="targets"):
        lm_head_token_stats(hidden, head, targets[:-1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        lm_head_token_stats(hidden, head, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        lm_head_token_stats(hidden, head, targets, temperature=0.0)


def _saved_for_backward(fn, params):
    """Shapes and total bytes of the activations autograd saves while fn() runs its forward.

    Parameters are excluded: they exist anyway and are not activations.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    shapes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_ptrs:
            shapes.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes, sum(b for _, b in shapes)


def test_lean_head_saves_no_logits_for_backward():
    """Structural bound on memory: forward saves O(N*H + N) bytes and no [N, V] or [chunk, V] tensor.

    Fails if the chunks are not checkpointed (each would save its [chunk, V] logits).
    """
    n, h, v, chunk = 64, 8, 256, 16
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    params = list(head.parameters())

    ours, ours_bytes = _saved_for_backward(
        lambda: lm_head_token_stats(hidden, head, targets, chunk_tokens=chunk, entropy=True, kl_uniform=True), params
    )
    naive, naive_bytes = _saved_for_backward(lambda: _naive(head, hidden, targets, 1.0), params)

    bound = 2 * (n * h * 4 + n * 8)  # hidden chunks (fp32) and targets (int64), with slack 2
    assert ours_bytes <= bound, ours
    assert all(math.prod(shape) < chunk * v for shape, _ in ours), ours
    # The naive path keeps full [N, V] tensors: the check above would catch them.
    assert any(math.prod(shape) >= n * v for shape, _ in naive)
    assert naive_bytes >= 2 * n * v * 4 > 10 * ours_bytes


def test_scatter_to_mask_round_trip_and_gradient():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    out = scatter_to_mask(values, mask, fill=-1.0)
    assert torch.equal(out.detach(), torch.tensor([[-1.0, 1, 2, -1], [-1, -1, -1, -1], [3, 4, -1, 5]]))
    assert torch.equal(out[mask], values)  # x[mask] is the inverse
    (out * torch.arange(12.0).view(3, 4)).sum().backward()
    assert torch.equal(values.grad, torch.tensor([1.0, 2.0, 8.0, 9.0, 11.0]))
    padded = torch.randn(3, 4)
    assert torch.equal(scatter_to_mask(padded[mask], mask)[mask], padded[mask])
    with pytest.raises(ValueError, match="values"):
        scatter_to_mask(values[:4], mask)


def test_response_selection_layout_matches_trainer_logits():
    """hidden[:, :-1][mask] then scatter_to_mask gives the [b, T-1] layout of the old per-position path."""
    b, t = 3, 7
    head, _, _, _ = _setup()
    hidden_states = torch.randn(b, t, H)
    ids = torch.randint(0, V, (b, t))
    mask = torch.zeros(b, t - 1, dtype=torch.bool)
    mask[0, 2:5] = True
    mask[2, 1:6] = True
    s = lm_head_token_stats(hidden_states[:, :-1][mask], head, ids[:, 1:][mask], chunk_tokens=3)
    old = token_logprobs(head(hidden_states)[:, :-1].float(), ids[:, 1:])  # [b, T-1]
    torch.testing.assert_close(scatter_to_mask(s.logprobs, mask), torch.where(mask, old, 0.0))


def test_held_back_rows_take_the_softmax_without_the_held_ids_by_hand():
    # One row, V = 3, logits (0, 0, log 2), id 2 held back: p = (1/2, 1/2, 0) instead of (1/4, 1/4, 1/2).
    head = torch.nn.Linear(1, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [0.0], [math.log(2.0)]]))
    hidden, targets = torch.ones(2, 1), torch.tensor([0, 0])
    s = lm_head_token_stats(
        hidden,
        head,
        targets,
        entropy=True,
        held_rows=torch.tensor([True, False]),
        held_ids=torch.tensor([2]),
    )
    torch.testing.assert_close(s.logprobs, torch.tensor([math.log(0.5), math.log(0.25)]))
    want_free = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    torch.testing.assert_close(s.entropy, torch.tensor([math.log(2.0), want_free]))


@pytest.mark.parametrize("chunk", [1, 5, 23])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_held_back_rows_match_the_naive_masked_softmax_values_and_gradients(chunk, temperature):
    head, hidden, targets, coef = _setup(bias=True)
    held_ids = torch.tensor([3, 17, 40])
    held_rows = torch.arange(N) % 3 != 1  # chunks with and without held rows
    targets = torch.where(held_rows & torch.isin(targets, held_ids), 0, targets)  # a held id is never sampled

    def naive():
        logits = head(hidden).float() / temperature  # [N, V]
        masked = logits.index_fill(-1, held_ids, float("-inf"))
        logits = torch.where(held_rows[:, None], masked, logits)
        logp = logits.log_softmax(-1)
        p = logp.exp()
        ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
        return logp.gather(-1, targets[:, None])[:, 0], ent, torch.zeros(N)

    def ours():
        s = lm_head_token_stats(
            hidden,
            head,
            targets,
            temperature=temperature,
            chunk_tokens=chunk,
            entropy=True,
            held_rows=held_rows,
            held_ids=held_ids,
        )
        return s.logprobs, s.entropy, torch.zeros(N)

    want = _values_and_grads(naive, head, hidden, coef * 100)  # large output gradients: no overflow to nan
    got = _values_and_grads(ours, head, hidden, coef * 100)
    for name, g, w in zip(["logprobs", "entropy", "kl", "d hidden", "d weight"], got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=name)


def test_held_back_rows_refuse_kl_uniform_and_half_arguments():
    head, hidden, targets, _ = _setup()
    rows, ids = torch.ones(N, dtype=torch.bool), torch.tensor([1])
    with pytest.raises(ValueError, match="infinite"):
        lm_head_token_stats(hidden, head, targets, kl_uniform=True, held_rows=rows, held_ids=ids)
    with pytest.raises(ValueError, match="together"):
        lm_head_token_stats(hidden, head, targets, held_rows=rows)
