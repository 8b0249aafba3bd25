"""model.fused_kernels (trapo/engine/fused_ops.py) on CPU: a fused toy-shaped Qwen2 computes the loss and the
gradients of the plain one, the fused functions trace whole for torch.compile (what inductor gets on a GPU),
and forwards without gradients (generation) keep the plain ops."""

import sys

import pytest
import torch

from trapo.commands.toy import _model, _tokenizer
from trapo.engine import fused_ops


@pytest.fixture
def pair():
    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)])
    plain, fused = _model(tokenizer, seed=7), _model(tokenizer, seed=7)
    ids = torch.randint(3, plain.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    yield plain, fused, ids
    attention = sys.modules[type(plain.model.layers[0].self_attn).__module__]
    original = getattr(attention.apply_rotary_pos_emb, "fused_from", None)
    if original is not None:  # the swap is process-wide: the next test's models get the plain function back
        attention.apply_rotary_pos_emb = original


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_fused_model_trains_as_the_plain_one_and_every_op_is_routed(pair):
    plain, fused, ids = pair
    layers = plain.config.num_hidden_layers
    counted = fused_ops.fuse(fused, fused_ops.Kernels(compile=lambda fn: fn))
    assert counted == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rotary": 1}
    ref_loss, ref_grads = loss_and_grads(plain, ids)  # rotary is swapped for both (process-wide): its equality
    loss, grads = loss_and_grads(fused, ids)  # with transformers' is checked below
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], atol=1e-6), name


def test_the_fused_functions_trace_whole_and_serve_only_forwards_with_gradients(pair, monkeypatch):
    plain, fused, ids = pair
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # the runtime's CPU setting, read at each call
    traced = []

    def backend(graph, inputs):
        traced.append(graph)
        return graph.forward

    torch._dynamo.reset()
    kernels = fused_ops.Kernels(compile=lambda fn: torch.compile(fn, backend=backend, fullgraph=True, dynamic=True))
    fused_ops.fuse(fused, kernels)
    ref_loss, ref_grads = loss_and_grads(plain, ids)
    loss, grads = loss_and_grads(fused, ids)
    assert len(traced) >= 3  # norm, swiglu and rotary each traced as one graph
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    assert all(torch.allclose(g, ref_grads[n], atol=1e-6) for n, g in grads.items())
    traced.clear()
    with torch.no_grad():  # generation's forwards: the plain ops, nothing traced
        out = fused(input_ids=ids).logits
    assert traced == [] and torch.allclose(out, plain(input_ids=ids).logits.detach(), atol=1e-6)
    torch._dynamo.reset()


def test_rms_norm_swiglu_and_rotary_equal_transformers_ops():
    torch.manual_seed(0)
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    q, k, cos, sin = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    theirs = getattr(modeling_qwen2.apply_rotary_pos_emb, "fused_from", modeling_qwen2.apply_rotary_pos_emb)
    assert all(torch.equal(a, b) for a, b in zip(fused_ops.rotary(q, k, cos, sin), theirs(q, k, cos, sin)))

    norm = Qwen2RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.rand(16) + 0.5
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    assert torch.equal(fused_ops.rms_norm(x, norm.weight, 1e-6), norm(x))
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(fused_ops.silu_mul(gate, up), torch.nn.SiLU()(gate) * up)
