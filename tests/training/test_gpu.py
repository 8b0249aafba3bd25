"""The trainer on CUDA: bf16, vLLM sleep mode, offload, the health metric after every wake, resume; the hf
backend; the packed rows' varlen attention kernel.

Skipped without a CUDA GPU (CI has none). On a GPU node: `pytest -m gpu tests/training/test_gpu.py`
(two-rank and tensor-parallel cases need two GPUs; the vLLM cases need vLLM, the others do not: `make
gpu-check` runs them on a machine without it). Tolerances are bf16's, not bit equality:
vLLM's and the trainer's kernels differ on GPU, and the rollouts are not bit-reproducible there.
"""

import os
import sys

import pytest
import torch
from toyrun import metrics, overrides, run, train

from trapo.engine.rollout import installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.toy_run,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (on a GPU node: pytest -m gpu)"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU_RUN = {
    "model.dtype": "bfloat16",
    "rollout.enable_sleep_mode": "true",
    "train.offload_during_rollout": "true",
    "rollout.gpu_memory_utilization": 0.3,
}
BF16_HEALTH = 5e-2  # engine vs policy log-prob difference per token; stale weights after a wake jump far above
needs_vllm = pytest.mark.skipif(not installed("vllm"), reason="needs vLLM (the hf backend cases run without it)")
HF_RUN = {"model.dtype": "bfloat16", "rollout.backend": "hf"}


def straight_and_resumed(toy_dir, tmp_path, settings: dict) -> list[dict]:
    """4 steps straight, and 2 steps resumed to 4, which must follow it (bf16 on GPU: close, not bit-equal).
    Returns the straight run's metrics rows."""
    common = dict(mode="trapo", max_steps=4, save_steps=2, **settings)
    train(overrides(toy_dir, tmp_path, run_name="straight", **common))
    train(overrides(toy_dir, tmp_path, run_name="resumed", **{**common, "max_steps": 2}))
    train(overrides(toy_dir, tmp_path, run_name="resumed", resume_from="latest", **common))
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.1, abs=1e-3), (a["step"], a["loss"], b["loss"])
    return straight


def test_hf_backend_bf16_health_and_resume(toy_dir, tmp_path):
    """The policy generates (ZeRO-3 gathered once per round): its log-probs agree with the update's forward,
    and a resume from step 2 follows the straight run."""
    for r in straight_and_resumed(toy_dir, tmp_path, HF_RUN):
        assert r["logprob_diff_rollout_vs_policy"] < BF16_HEALTH, r
        assert r["pushed_gb"] == 0 and r["peak_gb"]["rollout"] > 0


def test_captured_decode_steps_replay_the_static_steps_exactly_and_follow_eager_decoding():
    """rollout.hf_decoding on CUDA (fp32, so the paths' kernels differ only in rounding): the CUDA-graph replays
    give the static steps' tokens and log-probs bit for bit (the same kernels, launched by a replay), and both
    follow eager decoding; rows end at many steps (compaction across buckets) and run past one cache span."""
    from trapo.commands.toy import _model, _tokenizer
    from trapo.engine.hf_rollout import HfEngine
    from trapo.engine.rollout import request_seed
    from trapo.engine.static_decoding import SPAN

    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)])
    model = _model(tokenizer, seed=5).to("cuda").eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "17+15=", "3+4=7 and 12+9=", "8")]
    stops = list(range(0, model.config.vocab_size, 40))
    seeds = [request_seed(4, i) for i in range(len(prompts))]
    runs = {}
    for decoding in ("eager", "static", "cuda_graph"):
        engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=64, decoding=decoding)
        out = engine.generate(prompts, n=6, temperature=1.0, max_tokens=SPAN + 16, seeds=seeds)
        runs[decoding] = [(r.token_ids, r.logprobs) for g in out for r in g]
    assert runs["cuda_graph"] == runs["static"]
    assert len({len(t) for t, _ in runs["static"]}) > 3  # rows ended at many different steps
    for (tokens, lps), (ref_tokens, ref) in zip(runs["static"], runs["eager"]):
        assert tokens == ref_tokens
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref), atol=1e-4)


def test_a_capture_that_fails_on_cuda_restores_the_stream_and_auto_decodes_eagerly():
    """A step that reads a value on the host (refused while capturing, as a host-syncing rotary update would be)
    under auto: the caller's stream is current again, the engine decodes eagerly with eager's samples and says
    eager; an explicit cuda_graph raises."""
    from trapo.commands.toy import _model, _tokenizer
    from trapo.engine.hf_rollout import HfEngine
    from trapo.engine.rollout import request_seed
    from trapo.engine.static_decoding import Captured, cuda_graph_capture

    tokenizer = _tokenizer([f"{a}+{b}={a + b}" for a in range(20) for b in range(20)])
    model = _model(tokenizer, seed=5).to("cuda").eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("1+2=", "17+15=", "8")]
    seeds = [request_seed(4, i) for i in range(len(prompts))]

    def syncing(step, pool):  # the step's output read on the host: fine in the warm-up, refused in the capture
        return cuda_graph_capture(lambda: (out := step(), out.sum().item())[0], pool)

    def generated(engine):
        out = engine.generate(prompts, n=4, temperature=1.0, max_tokens=12, seeds=seeds)
        return [(r.token_ids, r.logprobs) for g in out for r in g]

    default = torch.cuda.current_stream()
    eager = generated(HfEngine(model, tokenizer, stop_token_ids=[], max_batch=64, decoding="eager"))
    explicit = HfEngine(model, tokenizer, stop_token_ids=[], max_batch=64, decoding="cuda_graph")
    explicit._runner = Captured(capture=syncing)
    with pytest.raises(RuntimeError):
        generated(explicit)
    assert torch.cuda.current_stream() == default
    auto = HfEngine(model, tokenizer, stop_token_ids=[], max_batch=64, decoding="auto")
    assert auto.decoding == "cuda_graph"
    auto._runner = Captured(capture=syncing)
    assert generated(auto) == eager and auto.decoding == "eager" and auto._runner is None
    assert torch.cuda.current_stream() == default


def test_packed_rows_run_the_varlen_kernel_and_match_per_sequence_attention():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trapo.engine import attention

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    model.set_attn_implementation(attention.register_attention())
    with torch.no_grad():  # the choice checks gradients under enable_grad whatever the caller's mode
        choice = attention.choose_kernel(config, "cuda", torch.bfloat16)
    assert choice.kernel is not None, choice
    lengths = [37, 120, 5, 64]
    ids = torch.randint(0, 512, (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, packed_bounds=bounds).logits
        assert attention.KERNEL["name"] == attention.VARLEN, attention.KERNEL
        for a, b in zip(bounds, bounds[1:]):  # each sequence alone: what the pack must equal
            alone = model(input_ids=ids[:, a:b], position_ids=positions[:, a:b]).logits
            assert (packed[:, a:b].float() - alone.float()).abs().max() < 0.1


@needs_vllm
def test_bf16_sleep_offload_health_after_every_wake_and_resume(toy_dir, tmp_path):
    for r in straight_and_resumed(toy_dir, tmp_path, GPU_RUN):
        # every step's rollouts came after a level-2 sleep, a push and a wake
        assert r["logprob_diff_rollout_vs_policy"] < BF16_HEALTH, r
        assert r["peak_gb"]["update"] > 0 and r["peak_gb"]["rollout"] > 0


@needs_vllm
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_two_ranks_and_tensor_parallel_rollouts_on_gpu(toy_dir, tmp_path):
    for tp in (1, 2):
        name = f"tp{tp}"
        train(
            overrides(toy_dir, tmp_path, run_name=name, max_steps=2, **GPU_RUN, **{"rollout.tensor_parallel_size": tp}),
            nproc=2,
        )
        assert all(r["logprob_diff_rollout_vs_policy"] < BF16_HEALTH for r in metrics(tmp_path / name))


def test_doctor_passes_on_this_gpu():
    backend = [] if installed("vllm") else ["rollout.backend=hf"]
    out = run([sys.executable, "-m", "trapo", "doctor", *backend])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bus" in out.stdout and "peak" in out.stdout


def test_update_benchmark_runs_on_this_gpu():
    out = run([sys.executable, os.path.join("bench", "bench_update_gpu.py"), "--steps", "1", "--seqs", "8"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ours (chunked head)" in out.stdout and "full logits" in out.stdout
