"""Static decoding (trapo/engine/static_decoding.py) on CPU: its shapes, the choice of path, and generation
with the static steps called, captured through a stand-in for CUDA graphs, and traced by torch.compile, each
equal to eager decoding with the same seeds."""

import contextlib

import pytest
import torch

from trapo.commands.toy import _model, _tokenizer
from trapo.config import ConfigError
from trapo.engine import static_decoding
from trapo.engine.hf_rollout import HfEngine
from trapo.engine.rollout import request_seed
from trapo.engine.static_decoding import (
    BUCKETS,
    SPAN,
    Captured,
    Compiled,
    bucket,
    resolve,
    span_for,
    static_supported,
)


@pytest.fixture(scope="module")
def toy():
    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)])
    model = _model(tokenizer, seed=5).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "17+15=", "3+4=7 and 12+9=", "8")]
    return model, tokenizer, prompts


def generated(engine, prompts, **kw):
    seeds = [request_seed(4, i) for i in range(len(prompts))]
    out = engine.generate(prompts, seeds=seeds, **kw)
    return [(r.token_ids, r.logprobs, r.truncated) for g in out for r in g]


def assert_same(ours, eager):
    assert [(t, c) for t, _, c in ours] == [(t, c) for t, _, c in eager]
    for (_, lps, _), (_, ref, _) in zip(ours, eager):
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref), atol=1e-5)


def stand_in_capture(captured: list):
    """torch.cuda.graph's contract on CPU: the step runs once at capture; a replay runs it again on whatever
    its buffers hold and writes into the one output tensor the capture returned."""

    def capture(step, pool):
        output = step()
        captured.append(tuple(output.shape))
        return (lambda: output.copy_(step())), output, pool

    return capture


def test_buckets_waste_at_most_a_third_and_spans_cover_what_is_filled():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 200, 256, 257)] == [1, 2, 3, 4, 6, 8, 12, 16, 256, 256, 384]
    assert all((bucket(n) - n) / bucket(n) <= 1 / 3 for n in range(1, 4096))
    assert bucket(5000) == 6144 and bucket(7000) == 7168 and BUCKETS == sorted(BUCKETS)
    assert [span_for(f, 600) for f in (1, SPAN, SPAN + 1, 599)] == [SPAN, SPAN, 2 * SPAN, 600]
    # past 8 spans the grain is an eighth of the power of two below: at most an eighth over, 8 spans a doubling
    assert [span_for(f, 10**6) for f in (1024, 1025, 2047, 2048, 2049)] == [1024, 1152, 2048, 2048, 2304]
    assert all(span_for(f, 10**6) - f <= max(SPAN, f / 8) for f in range(1, 20000))
    assert len({span_for(f, 10**6) for f in range(4097, 8193)}) == 8  # 4608, 5120, ..., 8192


def test_auto_captures_on_cuda_only_for_full_attention_models_and_explicit_choices_are_checked(toy):
    model = toy[0]
    assert resolve("auto", "cpu", model)[0] == "eager"
    assert resolve("auto", "cuda:0", model) == ("cuda_graph", "auto: a CUDA device and a model that decodes statically")
    assert resolve("static", "cpu", model) == ("static", "as configured")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve("cuda_graph", "cpu", model)
    with pytest.raises(ConfigError, match="is not one of auto, eager, static, cuda_graph, compile"):
        resolve("graphs", "cpu", model)
    sliding = _model(toy[1], seed=5)
    sliding.config.layer_types = ["sliding_attention"] * len(sliding.config.layer_types)
    decoding, why = resolve("auto", "cuda:0", sliding)
    assert decoding == "eager" and "sliding_attention" in why
    with pytest.raises(ConfigError, match="only full attention"):
        resolve("static", "cpu", sliding)


def test_models_a_capture_cannot_take_decode_eagerly_under_auto_and_are_refused_by_static(toy):
    """Rotary updates that read the positions on the host (transformers' dynamic and longrope types), a
    sliding window without layer types (Mistral's), chunked attention: auto says why and decodes eagerly."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    dynamic = LlamaForCausalLM(
        LlamaConfig(**shape, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    )
    assert static_decoding.rope_types(dynamic) == {"dynamic"}
    longrope = LlamaForCausalLM(LlamaConfig(**shape))
    assert static_supported(longrope) is None and static_decoding.rope_types(longrope) == {"default"}
    longrope.model.rotary_emb.rope_type = "longrope"  # as Phi-3's long-context configs build it
    mistral = MistralForCausalLM(MistralConfig(**shape, sliding_window=16))
    chunked = LlamaForCausalLM(LlamaConfig(**shape))
    chunked.config.attention_chunk_size = 8  # Llama 4's chunked attention
    for model, says in (
        (dynamic, "rope type dynamic reads the positions on the host"),
        (longrope, "rope type longrope reads the positions on the host"),
        (mistral, "sliding_window=16"),
        (chunked, "attention_chunk_size=8"),
    ):
        decoding, why = resolve("auto", "cuda:0", model)
        assert decoding == "eager" and why == f"auto: {static_supported(model)}" and says in why
        with pytest.raises(ConfigError, match="use eager"):
            resolve("cuda_graph", "cuda:0", model)
    assert static_supported(MistralForCausalLM(MistralConfig(**shape, sliding_window=None))) is None


def test_static_steps_past_several_spans_equal_eager_decoding(toy):
    """No stop token: every row runs 2.5 spans of the cache; then many stop tokens: rows leave the batch at
    different steps and the live ones move to the buffers' front, bucket by bucket."""
    model, tokenizer, prompts = toy
    for stops, kw in (([], dict(n=3, max_tokens=SPAN * 5 // 2)), (list(range(0, 400, 3)), dict(n=6, max_tokens=20))):
        stops = [s for s in stops if s < model.config.vocab_size]
        eager = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="eager")
        static = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="static")
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9)):
            ref = generated(eager, prompts, **kw, **sampling)
            assert_same(generated(static, prompts, **kw, **sampling), ref)
        if stops:
            assert len({len(t) for t, _, _ in ref}) > 3  # rows ended at many different steps


def test_a_llama_model_decodes_statically_as_it_does_eagerly(toy):
    """Llama's forward builds its mask with create_causal_mask alone (no per-layer-type mapping, unlike Qwen2's):
    the step's 4D mask goes through it as it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer, prompts = toy
    torch.manual_seed(1)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, max_position_embeddings=512, **shape)
    model = LlamaForCausalLM(config).eval()
    stops = list(range(0, config.vocab_size, 9))
    eager = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="eager")
    static = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="static")
    captured = []
    static._runner = Captured(capture=stand_in_capture(captured))
    ref = generated(eager, prompts, n=4, temperature=1.0, max_tokens=SPAN + 4)
    assert_same(generated(static, prompts, n=4, temperature=1.0, max_tokens=SPAN + 4), ref)
    assert captured and len({len(t) for t, _, _ in ref}) > 2


def test_captured_steps_replay_the_buffers_and_are_captured_once_per_shape(toy):
    model, tokenizer, prompts = toy
    stops = list(range(0, model.config.vocab_size, 40))  # some rows end early, some run past one span
    eager = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="eager")
    engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="static")
    captured = []
    engine._runner = Captured(capture=stand_in_capture(captured))
    ref = generated(eager, prompts, n=5, temperature=1.0, max_tokens=SPAN + 8)
    with engine.turn():  # a round's batches share one turn: buffers and captures kept from one to the next
        assert_same(generated(engine, prompts, n=5, temperature=1.0, max_tokens=SPAN + 8), ref)
        shapes = list(engine._runner.graphs)  # in the order captured
        assert captured == [(rows, model.config.vocab_size) for rows, _ in shapes]  # each step's logits, its rows
        assert {rows for rows, _ in shapes} <= set(BUCKETS) and {span for _, span in shapes} == {SPAN, 2 * SPAN}
        kv = engine._static["kv"]
        assert_same(generated(engine, prompts, n=5, temperature=1.0, max_tokens=SPAN + 8), ref)
        assert len(captured) == len(shapes) and engine._static["kv"] is kv  # the same buffers, nothing captured
        longer = generated(engine, prompts, n=5, temperature=1.0, max_tokens=3 * SPAN)  # outgrows the buffers
        assert engine._static["kv"] is not kv and engine._static["kv"].length >= 3 * SPAN
    assert engine._static == {} and engine._runner.graphs == {}  # the turn's end frees them for the update
    assert_same(longer, generated(eager, prompts, n=5, temperature=1.0, max_tokens=3 * SPAN))
    captured.clear()
    assert_same(generated(engine, prompts, n=5, temperature=1.0, max_tokens=SPAN + 8), ref)  # captured anew
    assert len(captured) == len(shapes)


class StandInCuda:
    """torch.cuda's streams and graphs as cuda_graph_capture uses them, on CPU: which stream is current, what
    the capture began and ended; `fail` raises at "begin" (capture_begin), "during" (the step's first kernel
    launched while capturing, as an op CUDA refuses inside a capture does) or "end" (capture_end)."""

    def __init__(self, fail: str | None = None):
        self.fail, self.calls, self.capturing = fail, [], False
        self.current = self.default = self.Stream()

    class Stream:
        def wait_stream(self, other):
            pass

    def current_stream(self):
        return self.current

    def set_stream(self, stream):
        self.current = stream

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def CUDAGraph(self):  # noqa: N802 - torch.cuda's name
        cuda = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                cuda.calls.append("begin")
                if cuda.fail == "begin":
                    raise RuntimeError("CUDA error: operation not permitted (capture_begin)")
                cuda.capturing = True

            def capture_end(self):
                cuda.calls.append("end")
                cuda.capturing = False
                if cuda.fail in ("end", "during"):
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self):
                pass

            def pool(self):
                return None

        return Graph()


@pytest.mark.parametrize("fail", ["begin", "during", "end"])
def test_a_failed_capture_restores_the_stream_and_auto_decodes_eagerly_while_cuda_graph_raises(toy, fail):
    model, tokenizer, prompts = toy
    cuda = StandInCuda(fail)

    def step_under(step):
        def run():
            if cuda.capturing and cuda.fail == "during":
                raise RuntimeError("operation not permitted when stream is capturing")
            return step()

        return run

    def capture(step, pool):
        return static_decoding.cuda_graph_capture(step_under(step), pool, cuda=cuda)

    with pytest.raises(RuntimeError, match="not permitted|previous error"):
        static_decoding.Captured(capture=capture)((1, SPAN), lambda: torch.zeros(2))
    assert cuda.current is cuda.default and not cuda.capturing  # the caller's stream, the capture ended
    assert cuda.calls == (["begin"] if fail == "begin" else ["begin", "end"])

    eager = HfEngine(model, tokenizer, stop_token_ids=[], max_batch=64, decoding="eager")
    ref = generated(eager, prompts, n=2, temperature=1.0, max_tokens=6)
    engine = HfEngine(model, tokenizer, stop_token_ids=[], max_batch=64, decoding="static")
    engine.decoding, engine._runner = "cuda_graph", Captured(capture=capture)  # rollout.hf_decoding=cuda_graph
    with pytest.raises(RuntimeError):
        generated(engine, prompts, n=2, temperature=1.0, max_tokens=6)
    assert cuda.current is cuda.default
    engine.requested, engine._runner = "auto", Captured(capture=capture)  # as auto chose it on a GPU
    assert generated(engine, prompts, n=2, temperature=1.0, max_tokens=6) == ref  # the batch again, eagerly
    assert engine.decoding == "eager" and engine._runner is None and "RuntimeError" in engine.decoding_why
    assert cuda.current is cuda.default
    assert generated(engine, prompts, n=2, temperature=1.0, max_tokens=6) == ref  # later batches eager too


def test_static_steps_that_fail_under_auto_leave_the_engine_decoding_eagerly_with_eagers_samples(toy):
    """A model whose forward the static path does not fit (stood in for by a step that raises): under auto the
    batch is generated again eagerly and so is every later one; an explicit choice raises."""
    model, tokenizer, prompts = toy

    class Unfit(static_decoding.Called):
        def __call__(self, key, step):
            raise TypeError("forward() got an unexpected mask")

    eager = HfEngine(model, tokenizer, stop_token_ids=[], max_batch=3, decoding="eager")
    ref = generated(eager, prompts, n=2, temperature=1.0, max_tokens=6)
    engine = HfEngine(model, tokenizer, stop_token_ids=[], max_batch=3, decoding="static")
    engine._runner = Unfit()
    with pytest.raises(TypeError, match="unexpected mask"):  # rollout.hf_decoding=static: as it is
        generated(engine, prompts, n=2, temperature=1.0, max_tokens=6)
    engine.requested = "auto"  # as auto chose it on a GPU
    assert generated(engine, prompts, n=2, temperature=1.0, max_tokens=6) == ref  # 3 batches: the first retried
    assert engine.decoding == "eager" and engine._runner is None and "TypeError" in engine.decoding_why
    assert model.config._attn_implementation == "sdpa"  # the turn put the model's own back


def test_the_static_step_traces_whole_for_torch_compile(toy, monkeypatch):
    """dynamo's eager backend with fullgraph: the step traces as inductor would get it, with no graph break
    (a break would leave part of the step outside the CUDA graphs reduce-overhead captures)."""
    model, tokenizer, prompts = toy
    stops = list(range(0, model.config.vocab_size, 4))
    eager = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="eager")
    engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding="static")
    graphs = []

    def traced(graph, inputs):  # dynamo's output, run as traced (no inductor on CPU)
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # the runtime's CPU setting, read at each call
    engine._runner = Compiled(model, backend=traced, fullgraph=True)
    ours = generated(engine, prompts, n=3, temperature=1.0, max_tokens=12)
    torch._dynamo.reset()
    assert_same(ours, generated(eager, prompts, n=3, temperature=1.0, max_tokens=12))
    assert len(graphs) >= 2  # one whole graph per (rows, span) the batch ran at


def test_static_decoding_attends_with_grouped_heads_as_sdpa_does():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.rand(3, 1, 1, 40) > 0.3
    mask[:, :, :, 0] = True
    module = type("Attention", (), {"num_key_value_groups": 4})()
    ours, _ = static_decoding.static_attention(module, q, k, v, mask, scaling=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, scale=0.25
    )
    assert torch.allclose(ours, ref.transpose(1, 2), atol=1e-6)


def test_the_compiled_path_drops_its_graphs_each_turn_and_says_steps_run_without_them(toy, capsys):
    """Inductor counts each step it runs without the CUDA graphs reduce-overhead asked for
    (log_cudagraph_skip_and_bump_counter); the turn's end says so once, instead of torch's log alone."""
    from torch._dynamo.utils import counters

    from trapo import console

    console._warned.discard("compile-skips")
    runner = Compiled(toy[0], backend="eager")
    runner.reset()  # a turn without skips: nothing said
    assert "without CUDA graphs" not in capsys.readouterr().err
    counters["inductor"]["cudagraph_skips"] += 3  # as inductor bumps it when it skips a step's graphs
    runner.reset()
    assert "torch.compile ran 3 decode steps without CUDA graphs" in capsys.readouterr().err
    counters["inductor"]["cudagraph_skips"] += 1
    runner.reset()
    assert "without CUDA graphs" not in capsys.readouterr().err  # said once
