"""The hf backend's decode loop parts (trapo/engine/decoding.py, dist.plain_linear_forward) against what they
replace: transformers' concatenating cache, its sdpa attention with repeated heads, DeepSpeed's linear."""

import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trapo.commands.toy import _model, _tokenizer
from trapo.engine import decoding, dist
from trapo.engine.hf_rollout import HfEngine
from trapo.engine.rollout import request_seed


def test_a_reserved_layer_holds_what_a_concatenating_layer_holds_through_growth_and_compaction():
    torch.manual_seed(0)
    plain, reserved = DynamicLayer(), decoding.ReservedLayer(capacity=6)
    for length in (4, 1, 1, 1, 3):  # a prefill of 4, three tokens, then past the capacity of 6: it doubles
        k, v = torch.randn(5, 2, length, 8), torch.randn(5, 2, length, 8)
        assert all(torch.equal(a, b) for a, b in zip(plain.update(k, v), reserved.update(k, v)))
    assert reserved.get_seq_length() == plain.get_seq_length() == 10 and reserved.capacity == 12
    keep = torch.tensor([0, 3, 4])
    plain.batch_select_indices(keep)
    reserved.batch_select_indices(keep)
    k, v = torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
    assert all(torch.equal(a, b) for a, b in zip(plain.update(k, v), reserved.update(k, v)))
    moved = decoding.ReservedLayer.holding(plain, capacity=20)  # a prefill's layer moved in
    assert torch.equal(moved.keys, plain.keys) and moved.capacity == 20


class _Grouped(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_decode_attention_reads_grouped_heads_in_place_and_equals_sdpa_with_repeated_heads():
    torch.manual_seed(1)
    buffer = torch.randn(6, 2, 40, 16)
    key, value = buffer[:, :, :23], torch.randn(6, 2, 40, 16)[:, :, :23]  # views of a reserved cache
    query = torch.randn(6, 4, 1, 16)
    mask = torch.ones(6, 1, 1, 23, dtype=torch.bool)
    mask[:3, :, :, :5] = False  # left padding
    ours, _ = decoding.decode_attention(_Grouped(), query, key, value, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(_Grouped(), query, key, value, mask, scaling=0.25)
    assert ours.shape == (6, 1, 4, 16) and torch.equal(ours, ref)
    prefill = torch.randn(6, 4, 23, 16)  # more than one query token: transformers' own path
    causal = torch.ones(23, 23, dtype=torch.bool).tril()[None, None].expand(6, 1, 23, 23)
    ours, _ = decoding.decode_attention(_Grouped(), prefill, key, value, causal, scaling=0.25)
    assert torch.equal(ours, sdpa_attention_forward(_Grouped(), prefill, key, value, causal, scaling=0.25)[0])


def test_plain_linear_forward_computes_deepspeeds_linear_without_its_autograd_function():
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    F = torch.nn.functional
    layer = torch.nn.Linear(8, 5)
    x = torch.randn(3, 4, 8)
    native = F.linear
    F.linear = zero3_linear_wrap  # what zero.Init leaves behind, process-wide
    try:
        with torch.no_grad():
            wrapped = layer(x)
            with dist.plain_linear_forward():
                assert F.linear is not zero3_linear_wrap
                assert torch.equal(layer(x), wrapped)
            assert F.linear is zero3_linear_wrap  # restored
        with dist.plain_linear_forward():  # gradients on: DeepSpeed's Function stays (its backward is needed)
            assert F.linear is zero3_linear_wrap
    finally:
        F.linear = native
    with torch.no_grad(), dist.plain_linear_forward():  # no ZeRO-3 patch: nothing changes
        assert F.linear is native


def test_generation_with_the_reserved_cache_equals_generation_with_the_concatenating_one():
    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)])
    model = _model(tokenizer, seed=5).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "17+15=", "3+4=7 and 12+9=")]
    stops = list(range(0, model.config.vocab_size, 4))  # rows end at different steps: compaction happens
    seeds = [request_seed(1, i) for i in range(len(prompts))]
    runs = []
    for joinable in (True, False):  # False: the prefill's DynamicCache decodes as transformers builds it
        engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64)
        engine.joinable_cache = joinable
        out = engine.generate(prompts, n=5, temperature=1.0, max_tokens=16, seeds=seeds)
        runs.append([(r.token_ids, r.logprobs) for g in out for r in g])
    assert runs[0] == runs[1]
    assert len({len(ids) for ids, _ in runs[0]}) > 2  # rows of several lengths
