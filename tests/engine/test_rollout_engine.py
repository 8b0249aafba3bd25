"""The rollout engine's interface: both backends take what `RolloutEngine` declares, and the one factory opens
each for its backend, for a training run and for `trapo eval` (vLLM's engine stubbed here: nothing starts;
tests/training/test_trainer_e2e.py checks a real one against the protocol)."""

import inspect
from types import SimpleNamespace

import pytest

from trapo.config import Config
from trapo.engine import vllm_rollout
from trapo.engine.hf_rollout import HfEngine
from trapo.engine.rollout_engine import EngineSettings, RolloutEngine, open_engine
from trapo.engine.vllm_rollout import VllmEngine
from trapo.runtime import dtype_name
from trapo.training.settings import engine_settings

METHODS = sorted(name for name, v in vars(RolloutEngine).items() if callable(v) and not name.startswith("_"))


def parameters(function) -> list[tuple]:
    """(name, kind, default) of each parameter after self: what a caller may pass, annotations aside."""
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[1:]]


def test_the_protocol_declares_what_the_trainer_and_eval_call():
    assert METHODS == ["describe", "device", "effective_config", "generate", "push_weights", "turn"]


@pytest.mark.parametrize("backend", [HfEngine, VllmEngine], ids=["hf", "vllm"])
@pytest.mark.parametrize("method", METHODS)
def test_each_backend_takes_what_the_interface_declares(backend, method):
    assert parameters(getattr(backend, method)) == parameters(getattr(RolloutEngine, method))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trapo.commands.toy import _model, _tokenizer

    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(10) for b in range(10)])
    model = _model(tokenizer, seed=0).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, str(path)


def test_the_factory_opens_the_hf_engine_on_the_policy_or_on_the_model_dir(tiny):
    model, tokenizer, path = tiny
    cfg = Config()
    cfg.rollout.backend, cfg.rollout.hf_max_batch = "hf", 3
    policy = SimpleNamespace(model=model, engine=None, overrides={})  # what the factory reads of a Policy
    settings = engine_settings(cfg, rank=0, world=1, overrides=policy.overrides)
    stops = [tokenizer.eos_token_id]
    trained = open_engine(settings, path, tokenizer=tokenizer, stop_token_ids=stops, policy=policy)
    assert isinstance(trained, HfEngine) and trained.model is model and trained.max_batch == 3
    evaluated = open_engine(
        EngineSettings(backend="hf", dtype="float32", max_model_len=32, seed=0, hf_max_batch=2),
        path,
        tokenizer=tokenizer,
        stop_token_ids=stops,
    )
    assert isinstance(evaluated, HfEngine) and evaluated.model is not model and evaluated.max_batch == 2
    for engine in (trained, evaluated):
        assert isinstance(engine, RolloutEngine)
        assert engine.effective_config() is None  # the policy's own model (eval: the one it loaded): no copy
        assert engine.push_weights(iter([])) == 0
        assert engine.describe(["cpu"]).endswith(
            "rank 0 cpu; decoding eager (auto: no CUDA device, nothing to capture)"
        )
        with engine.turn():
            [[rollout]] = engine.generate([tokenizer("1+2=")["input_ids"]], n=1, temperature=0.0, max_tokens=3)
        assert 1 <= len(rollout.token_ids) <= 3


class Recorder:
    """VllmEngine's constructor, recorded instead of run."""

    def __init__(self, model_dir, **kwargs):
        self.model_dir, self.kwargs = model_dir, kwargs


def test_the_factory_sizes_vllm_by_the_run_or_leaves_evals_defaults(monkeypatch):
    monkeypatch.setattr(vllm_rollout, "VllmEngine", Recorder)
    cfg = Config(seed=7)
    cfg.model.dtype, cfg.data.max_prompt_tokens, cfg.train.rollout_batch_size = "bfloat16", 100, 8
    r = cfg.rollout
    r.backend = "vllm"  # named: the default, auto, is chosen by the trainer before an engine opens
    r.max_tokens, r.n, r.tensor_parallel_size, r.gpu_memory_utilization = 50, 4, 2, 0.5
    policy = SimpleNamespace(model=None, engine=None, overrides={"rope_theta": 40000.0})
    settings = engine_settings(cfg, rank=3, world=4, overrides=policy.overrides)
    run = open_engine(settings, "m", tokenizer="tok", stop_token_ids=[2], policy=policy)
    assert run.model_dir == "m" and run.kwargs == dict(
        tokenizer="tok",
        dtype="bfloat16",
        max_model_len=150,
        seed=7 + 3 // 2,  # one seed per tensor-parallel group
        hf_overrides={"rope_theta": 40000.0},
        stop_token_ids=[2],
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
        cpu_kv_cache_gb=r.cpu_kv_cache_gb,
        enable_sleep_mode=r.enable_sleep_mode,
        enable_prefix_caching=r.enable_prefix_caching,
        sampled_logprobs=True,
        max_num_seqs=8 // 4 * 2 * 4,
    )
    evaluated = open_engine(
        EngineSettings(backend="vllm", dtype="auto", max_model_len=64, seed=1), "m", tokenizer="tok", stop_token_ids=[2]
    )
    assert evaluated.kwargs == dict(
        tokenizer="tok", dtype=dtype_name("auto"), max_model_len=64, seed=1, hf_overrides={}, stop_token_ids=[2]
    )
