"""The hf rollout backend alone: its sampling math, and generation with a real (random) toy-shaped Qwen2 on CPU,
compared with transformers' own `generate` and a plain forward."""

import math

import pytest
import torch

from trapo.commands.toy import _model, _tokenizer
from trapo.engine.hf_rollout import HfEngine, mix32, sample_tokens, top_p_filter, uniform_draws
from trapo.engine.rollout import decode_responses, request_seed


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers: the reference for the tensor version."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_equals_the_integer_hash_without_overflow():
    values = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert mix32(torch.tensor(values, dtype=torch.int64)).tolist() == [lowbias32(v) for v in values]


def test_uniform_draws_are_a_function_of_key_and_step_only():
    keys = torch.tensor([7, 8, 9], dtype=torch.int64)
    u = uniform_draws(keys, 3)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(uniform_draws(keys[1:2], 3), u[1:2])  # another batch: the same draw
    assert not torch.equal(uniform_draws(keys, 4), u)  # another step: another draw
    many = uniform_draws(torch.arange(100000), 0)
    assert abs(float(many.mean()) - 0.5) < 0.005 and float(many.min()) < 1e-3 and float(many.max()) > 1 - 1e-3
    counts = torch.bincount((many * 10).long(), minlength=10)  # deciles within 3% of 10,000 each
    assert int(counts.min()) > 9700 and int(counts.max()) < 10300


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[math.log(0.15), math.log(0.5), math.log(0.05), math.log(0.3)]])
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.7) == [False, True, False, True]  # 0.5 < 0.7: the 0.3 token crosses it and stays
    assert kept(0.85) == [True, True, False, True]
    assert kept(1.0) == [True, True, True, True]
    assert kept(0.01) == [False, True, False, False]  # at least one token


def test_sampling_draws_from_the_processed_distribution_and_reports_its_logprob():
    probs = torch.tensor([0.1, 0.6, 0.05, 0.25])
    rows = 40000
    logits = probs.log().repeat(rows, 1) * 2.0  # temperature 2 undoes the scale
    tokens, lps = sample_tokens(logits, temperature=2.0, top_p=1.0, keys=torch.arange(rows), step=0)
    freq = torch.bincount(tokens, minlength=4).double() / rows
    assert torch.allclose(freq, probs.double(), atol=0.01), freq
    assert torch.allclose(lps, probs.log()[tokens], atol=1e-5)
    # top-p 0.8: only {0.6, 0.25} remain, renormalised; vLLM's processed log-probs are of that distribution
    tokens, lps = sample_tokens(logits, temperature=2.0, top_p=0.8, keys=torch.arange(rows), step=0)
    assert set(tokens.tolist()) == {1, 3}
    assert abs(float((tokens == 1).double().mean()) - 0.6 / 0.85) < 0.01
    assert torch.allclose(lps[tokens == 1], torch.tensor(math.log(0.6 / 0.85)), atol=1e-5)
    # greedy: the argmax, and the log-prob of the unscaled distribution
    tokens, lps = sample_tokens(logits[:2], temperature=0.0, top_p=1.0, keys=torch.arange(2), step=0)
    assert tokens.tolist() == [1, 1] and torch.allclose(lps, logits[0].log_softmax(-1)[1].repeat(2))


@pytest.fixture(scope="module")
def tiny():
    corpus = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    tokenizer = _tokenizer(corpus)
    model = _model(tokenizer, seed=3).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "17+25=", "3+4=5 and 12+9=", "8")]
    return model, tokenizer, prompts


# eager: transformers' kernels one launch at a time; static: the fixed-shape steps CUDA graphs capture
DECODINGS = pytest.mark.parametrize("decoding", ["eager", "static"])


@DECODINGS
def test_greedy_equals_transformers_generate_with_left_padding(tiny, decoding):
    model, tokenizer, prompts = tiny
    stop = tokenizer.eos_token_id
    engine = HfEngine(model, tokenizer, stop_token_ids=[stop], max_batch=8, decoding=decoding)
    ours = engine.generate(prompts, n=1, temperature=0.0, max_tokens=10)
    for prompt, (r,) in zip(prompts, ours):
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=stop,
            pad_token_id=stop,
        )[0, len(prompt) :].tolist()
        ref = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert r.token_ids == ref
        assert r.truncated == (len(ref) == 10 and ref[-1] != stop)
        assert r.text == decode_responses(tokenizer, [ref], [stop])[0]


@DECODINGS
def test_sampled_logprobs_equal_a_plain_forward_and_samples_do_not_depend_on_the_batch(tiny, decoding):
    model, tokenizer, prompts = tiny
    vocab = model.config.vocab_size
    stops = list(range(0, vocab, 3))  # many stop tokens: rows end at different steps (the batch compacts)
    engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding=decoding)
    seeds = [request_seed(0, 5, i) for i in range(len(prompts))]
    batch = engine.generate(prompts, n=6, temperature=0.9, max_tokens=12, seeds=seeds)
    lengths = {len(r.token_ids) for g in batch for r in g}
    assert len(lengths) > 2, lengths  # finished rows left the batch while others went on
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], n=6, temperature=0.9, max_tokens=12, seeds=[seeds[i]])[0]
        assert [r.token_ids for r in alone] == [r.token_ids for r in batch[i]]
        for r in batch[i]:
            ids = torch.tensor([prompt + r.token_ids])
            with torch.no_grad():
                logp = (model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.9).log_softmax(-1)
            expected = logp.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-5)
            assert r.token_ids[-1] in stops or (r.truncated and len(r.token_ids) == 12)
            assert all(t not in stops for t in r.token_ids[:-1])
    other = engine.generate(prompts, n=6, temperature=0.9, max_tokens=12, seeds=[s + 1 for s in seeds])
    assert [r.token_ids for g in other for r in g] != [r.token_ids for g in batch for r in g]


def test_the_model_is_left_as_it_was(tiny):
    model, tokenizer, prompts = tiny
    model.train()
    model.set_attn_implementation("eager")
    HfEngine(model, tokenizer, stop_token_ids=[tokenizer.eos_token_id]).generate(
        prompts[:1], n=2, temperature=1.0, max_tokens=3
    )
    assert model.training and model.config._attn_implementation == "eager"
    model.eval()
    model.set_attn_implementation("sdpa")


def test_prefill_in_groups_of_rows_generates_what_one_forward_does(tiny):
    """Prefill budgets of 5 rows, and of 1 row (a budget under one prompt), against one forward of the batch:
    the same tokens, greedy and sampled (top-p, rows finishing at different steps), and no prefill forward
    over its budget."""
    model, tokenizer, prompts = tiny
    width = max(len(p) for p in prompts)
    stops = list(range(0, model.config.vocab_size, 3))
    seeds = [request_seed(1, 2, i) for i in range(len(prompts))]
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        runs = {}
        for budget in (10**6, 5 * width + 2, 1):
            engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, prefill_tokens=budget)
            shapes.clear()
            greedy = engine.generate(prompts, n=6, temperature=0.0, max_tokens=8, seeds=seeds)
            sampled = engine.generate(prompts, n=6, temperature=0.9, top_p=0.9, max_tokens=8, seeds=seeds)
            runs[budget] = [[(r.token_ids, r.logprobs, r.truncated) for r in g] for g in greedy + sampled]
            prefills = [rows for rows, length in shapes if length > 1]
            assert prefills == {10**6: [24, 24], 5 * width + 2: [5, 5, 5, 5, 4] * 2, 1: [1] * 48}[budget]
    finally:
        hook.remove()
    one = runs[10**6]
    assert len({len(t) for g in one for t, _, _ in g}) > 2  # rows left the joined cache at different steps
    for budget in (5 * width + 2, 1):
        assert [[t for t, _, _ in g] for g in runs[budget]] == [[t for t, _, _ in g] for g in one]
        assert [[c for _, _, c in g] for g in runs[budget]] == [[c for _, _, c in g] for g in one]
        for grouped, whole in zip(runs[budget], one):
            for (_, lps, _), (_, ref, _) in zip(grouped, whole):
                assert torch.allclose(torch.tensor(lps), torch.tensor(ref), atol=1e-6)


@DECODINGS
def test_min_tokens_keeps_stop_tokens_out_until_then_and_reports_the_processed_logprob(tiny, decoding):
    model, tokenizer, prompts = tiny
    vocab = model.config.vocab_size
    stops = list(range(0, vocab, 3))  # a third of the vocabulary stops: unforced, most rows end early
    engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding=decoding)
    seeds = [request_seed(2, i) for i in range(len(prompts))]
    free = engine.generate(prompts, n=4, temperature=1.0, max_tokens=10, seeds=seeds)
    assert min(len(r.token_ids) for g in free for r in g) < 6
    forced = engine.generate(prompts, n=4, temperature=1.0, max_tokens=10, seeds=seeds, min_tokens=6)
    for prompt, group in zip(prompts, forced):
        for r in group:
            assert len(r.token_ids) >= 6 and all(t not in stops for t in r.token_ids[:6])
            with torch.no_grad():
                logits = model(torch.tensor([prompt + r.token_ids])).logits[0, len(prompt) - 1 : -1].float()
            logits[:6, stops] = float("-inf")  # the distribution the first 6 tokens were drawn from
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-5)
