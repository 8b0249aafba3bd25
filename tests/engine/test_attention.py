"""The packed rows' attention kernel (trapo/engine/attention.py): chosen once before any forward, checked
against per-sequence attention, then only read by the forward; a stand-in kernel stands for torch's CUDA
varlen kernel on CPU."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trapo.engine import attention

LENGTHS = [7, 12, 3, 9]
BOUNDS = [0, 7, 19, 22, 31]


@pytest.fixture(autouse=True)
def fresh_choices():
    attention.forget()
    yield
    attention.forget()


def counted(fn):
    """`fn` with a call counter (`.calls`), named for the log."""

    def kernel(q, k, v, bounds, scaling):
        kernel.calls += 1
        return fn(q, k, v, bounds, scaling)

    kernel.calls = 0
    kernel.__name__ = fn.__name__
    return kernel


def masked_pack(q, k, v, bounds, scaling):
    """A correct stand-in computed another way: one dense attention over the pack, block-diagonal causal mask."""
    total = q.shape[2]
    seq = torch.zeros(total, dtype=torch.long)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        seq[a:b] = i
    pos = torch.arange(total)
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=scaling)
    return out.transpose(1, 2)


def across_sequences(q, k, v, bounds, scaling):
    """A wrong kernel: causal over the whole pack, so tokens attend to earlier sequences."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling).transpose(1, 2)


def raises(q, k, v, bounds, scaling):
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")


def tiny_model(checkpointing: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(attention.register_attention())
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def packed_inputs():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (1, BOUNDS[-1]), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return dict(input_ids=ids, position_ids=positions, packed_bounds=BOUNDS)


def loss_and_grads(model) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**packed_inputs()).logits.float().square().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_attention_check_stand_in_kernel_runs_under_gradient_checkpointing():
    model = tiny_model(checkpointing=True)
    kernel = counted(masked_pack)
    choice = attention.choose_kernel(model.config, "cpu", torch.float32, kernel=kernel)
    assert choice.kernel is kernel and choice.why == ""
    checks = kernel.calls  # the self-check's own call
    loss, grads = loss_and_grads(model)  # the old in-forward check raised CheckpointError here
    # 2 layers in the forward, and again in the non-reentrant recompute of the backward
    assert kernel.calls - checks == 4 and attention.KERNEL == {"name": "masked_pack", "why": ""}
    attention.forget()  # the reference: per-sequence sdpa, the path every CPU run takes
    ref_loss, ref_grads = loss_and_grads(model)
    assert attention.KERNEL["name"] == attention.PER_SEQUENCE
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_attention_check_first_call_under_no_grad_keeps_the_kernel():
    model = tiny_model(checkpointing=True)
    kernel = counted(masked_pack)
    with torch.no_grad():  # e.g. reference log-probs before the first update
        choice = attention.choose_kernel(model.config, "cpu", torch.float32, kernel=kernel)
        assert choice.kernel is kernel, choice.why
        before = kernel.calls
        model(**packed_inputs())
        assert kernel.calls == before + 2
    loss_and_grads(model)  # the first forward with gradients still runs it
    assert kernel.calls == before + 2 + 4 and attention.KERNEL["name"] == "masked_pack"


@pytest.mark.parametrize("bad", [across_sequences, raises], ids=["differs", "raises"])
def test_attention_check_refuses_a_kernel_that_differs_or_raises(bad, capsys):
    model = tiny_model(checkpointing=True)
    kernel = counted(bad)
    choice = attention.choose_kernel(model.config, "cpu", torch.float32, kernel=kernel)
    assert choice.kernel is None
    expected = "output differs from per-sequence attention" if bad is across_sequences else "RuntimeError: Flash"
    assert expected in choice.why
    said = capsys.readouterr()
    assert f"packed attention: {bad.__name__} refused: {expected}" in said.out + said.err
    checks = kernel.calls
    loss_and_grads(model)
    assert kernel.calls == checks  # never run by the model
    assert attention.KERNEL["name"] == attention.PER_SEQUENCE and expected in attention.KERNEL["why"]


def test_attention_check_tolerance_is_relative_to_the_dtype_precision():
    config = tiny_model(checkpointing=False).config

    def off_by(ulps):
        def kernel(q, k, v, bounds, scaling):
            out = attention.reference_attention(q, k, v, bounds, scaling)
            return out * (1 + ulps * torch.finfo(out.dtype).eps)  # a relative error of `ulps` rounding steps

        kernel.__name__ = f"off_by_{ulps}"
        return kernel

    # about one bf16 rounding step (values in [8, 16) round by 0.0625, above the old absolute 5e-2): accepted
    assert attention.choose_kernel(config, "cpu", torch.bfloat16, kernel=off_by(1)).kernel is not None
    assert attention.choose_kernel(config, "cpu", torch.bfloat16, kernel=off_by(64)).kernel is None
    # the same relative error that bf16 tolerates is far outside fp32's precision
    bf16_step = torch.finfo(torch.bfloat16).eps / torch.finfo(torch.float32).eps
    assert attention.choose_kernel(config, "cpu", torch.float32, kernel=off_by(bf16_step)).kernel is None


def test_attention_check_without_a_gpu_chooses_per_sequence_and_says_why():
    config = tiny_model(checkpointing=False).config
    choice = attention.choose_kernel(config, "cpu", torch.bfloat16)
    assert choice.kernel is None and "CUDA" in choice.why
    assert attention.choose_kernel(config, "cpu", torch.bfloat16) is choice  # decided once per layout
