"""LoRA (model.lora) against full fine-tuning, and the two ways to get adapters into vLLM, side by side.

1. The update. Two ranks on CPU (gloo, one thread each), `Policy.update` as the trainer calls it, one update
   batch per rank of 8 responses of 48-112 tokens, on two models with random weights: the toy's shape and a
   tiny model of DeepSeek-R1-Distill-Qwen-1.5B's widths (hidden 1,536, MLP 8,960, 12 heads, 2 KV heads, its
   151,936-token vocabulary, untied head) with 2 layers instead of 28. Three set-ups:
   - full:     every parameter trains, ZeRO-3 (today's default);
   - lora-z3:  rank-8 adapters on the 7 projections, the frozen base partitioned by ZeRO-3 (what we ship);
   - lora-z2:  the same adapters, the frozen base replicated on every rank (ZeRO-2 partitions only what trains).
   The toy in fp32, the 1.5B shape in bf16 (fp32 master weights and Adam moments either way), DeepSpeed's
   gradient bucket at 5e7 elements. Printed per set-up: trainable parameters, rank 0's resident memory once
   built and its peak during the updates (sampled every 5 ms), and the median update time (3 after a warm-up).
2. The push after an update, on one rank with one vLLM engine per method (toy shape and the tiny 1.5B shape):
   - merged:   the gathered base with W + (alpha / r) B A computed per layer (trapo/engine/lora.py), loaded into
               vLLM in place (`reload_weights`, as trapo/engine/vllm_rollout.py does every step);
   - adapter:  the adapters written as a peft directory and loaded by vLLM's LoRA support
               (`enable_lora`; a new adapter id each step, as a new version must be read from disk);
   and the time of one generation round with each (64 prompts x 16 tokens), since an adapter is applied at
   every token while merged weights cost nothing at generation.
Run: make bench (or .venv/bin/python bench/bench_lora.py). Figures are this machine's, CPU only.
"""

import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trapo import runtime  # noqa: E402

runtime.configure()  # bounded threads before torch is imported

from trapo.commands.gpu_check.shape_step import R1_DISTILL_1P5B  # noqa: E402

WORLD, SEQS, REPEATS, PUSHES, RANK = 2, 8, 3, 3, 8
SETUPS = {
    "full": [],
    "lora-z3": [f"model.lora.rank={RANK}", "model.lora.alpha=16"],
    "lora-z2": [f"model.lora.rank={RANK}", "model.lora.alpha=16"],
}
SHAPES = {
    "toy": None,  # trapo/commands/toy.py MODEL_SHAPE, vocabulary 320
    # DeepSeek-R1-Distill-Qwen-1.5B's widths (gpu_check's shape step), 2 layers
    "1.5B-shaped (2 layers)": dict(R1_DISTILL_1P5B, num_hidden_layers=2, max_position_embeddings=2048),
}


# The toy trains in fp32 as on CPU; the 1.5B shape in bf16, as on a GPU (in fp32 its full fine-tuning would not
# fit two ranks in this machine's 24 GiB: the first attempt was killed for memory).
DTYPES = {"toy": "float32", "1.5B-shaped (2 layers)": "bfloat16"}


class PeakRss:
    """The process's resident memory, sampled every 5 ms while running (`with PeakRss() as peak: ...`)."""

    def __enter__(self):
        import psutil

        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def make_model(shape: dict | None, tokenizer_dir: str) -> str:
    """A model directory with random weights of `shape` (None: the toy's) and the toy's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trapo.commands.toy import MODEL_SHAPE

    torch.manual_seed(0)
    config = Qwen2Config(**(shape or dict(MODEL_SHAPE, vocab_size=320)), dtype="float32")
    out = tempfile.mkdtemp(prefix="bench-lora-")
    Qwen2ForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def update_worker(rank: int, port: int, model_dir: str, setup: str, dtype: str, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import json

    import psutil
    import torch

    from trapo.config import load_config
    from trapo.engine import dist
    from trapo.engine.batch import TrainSequence
    from trapo.training.settings import open_policy, planned

    dist.init_distributed()
    overrides = ["loss.entropy_coef=0.0", "train.micro_batch_tokens=1024", f"model.dtype={dtype}", *SETUPS[setup]]
    # configs/deepspeed_zero3.json with a 5e7-element gradient bucket (its 5e8 would take 2 GiB per rank in
    # fp32 here); lora-z2: the same as ZeRO stage 2
    ds = json.load(open(os.path.join(ROOT, "configs", "deepspeed_zero3.json")))
    ds["zero_optimization"].update(reduce_bucket_size=int(5e7))
    if setup == "lora-z2":
        ds["zero_optimization"] = {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": int(5e7),
        }
    path = os.path.join(model_dir, f"ds-{setup}.json")
    if rank == 0:
        json.dump(ds, open(path, "w"))
    dist.barrier()
    overrides.append(f"train.deepspeed_config={path}")
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), overrides)
    gen = torch.Generator().manual_seed(rank)
    seqs = []
    for i in range(SEQS):
        n = 16 + int(torch.randint(48, 113, (1,), generator=gen))
        ids = torch.randint(3, 300, (n,), generator=gen).tolist()
        seqs.append(TrainSequence(ids, 16, advantage=(-0.5, 0.5)[i % 2], weight=1.0, labeled=True))
    cfg = planned(cfg, model_dir, WORLD)  # the auto settings as the trainer decides them here
    policy = open_policy(cfg, model_dir, WORLD, 0)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in policy.model.parameters() if p.requires_grad)
    built = psutil.Process().memory_info().rss
    batch = dist.all_sum({"sequences": len(seqs), "tokens": sum(len(s.ids) - s.prompt_len for s in seqs)})
    times = []
    with PeakRss() as peak:
        for _ in range(REPEATS + 1):  # the first is a warm-up (Adam's moments are made at the first step)
            dist.barrier()
            start = time.perf_counter()
            policy.update(seqs, 0, batch)
            dist.barrier()
            times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put((trainable, built, peak.peak, statistics.median(times[1:])))


def collect(queue, procs):
    """The result a worker puts on `queue`; a worker that died (killed for memory, say) is an error, not a hang."""
    import queue as queues

    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a bench worker died (exit codes {dead}); its output is above") from None
    for p in procs:
        p.join()
    return result


def run_update(model_dir: str, setup: str, dtype: str):
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=update_worker, args=(r, port, model_dir, setup, dtype, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return collect(queue, procs)


def push_worker(model_dir: str, method: str, dtype: str, queue) -> None:
    """One vLLM engine; PUSHES pushes of a trained adapter's weights by `method`, then one generation round."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from trapo.config import LoraConfig
    from trapo.engine import lora

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    adapted = lora.attach(base, LoraConfig(rank=RANK, alpha=16))
    with torch.no_grad():  # a trained adapter: B away from zero
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)
    kwargs = dict(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0)
    if method == "adapter":
        kwargs.update(enable_lora=True, max_lora_rank=RANK, max_loras=1, max_cpu_loras=2)
    llm = LLM(**kwargs, kv_cache_memory_bytes=256 << 20)
    scale = lora.scalings(adapted)
    seconds, request = [], None
    work = tempfile.mkdtemp(prefix="bench-adapter-")
    for i in range(PUSHES):
        start = time.perf_counter()
        if method == "merged":
            named = ((n, p.detach().clone()) for n, p in adapted.named_parameters())
            llm.collective_rpc(
                "reload_weights",
                kwargs=dict(weights_iterator=lora.merged(named, scale), is_checkpoint_format=True),
            )
            llm.reset_prefix_cache()
        else:
            from vllm.lora.request import LoRARequest

            path = os.path.join(work, f"v{i}")
            adapted.save_pretrained(path)  # adapter_config.json + adapter_model.safetensors
            if request is not None:
                llm.llm_engine.remove_lora(request.lora_int_id)
            request = LoRARequest(f"policy-v{i}", i + 1, path)
            llm.llm_engine.add_lora(request)
        seconds.append(time.perf_counter() - start)
    prompts = [{"prompt_token_ids": [5 + i % 200, 7, 9]} for i in range(64)]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=1.0, seed=0)
    llm.generate(prompts[:2], params, lora_request=request, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, lora_request=request, use_tqdm=False)
    generate = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)
    queue.put((statistics.median(seconds[1:]), generate))


def run_push(model_dir: str, method: str, dtype: str):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=push_worker, args=(model_dir, method, dtype, queue))
    proc.start()
    return collect(queue, [proc])


def merge_drift(pairs: int = 100) -> float:
    """The share of a bf16 [1024, 1024] matrix's entries that `pairs` in-place merge / unmerge pairs of
    rank-8 updates (W += dW; W -= dW, as peft's merge_adapter / unmerge_adapter do) leave changed."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 1024, generator=gen).bfloat16()
    start = weight.clone()
    for _ in range(pairs):
        delta = (torch.randn(1024, 8, generator=gen) @ torch.randn(8, 1024, generator=gen) * 1e-3).bfloat16()
        weight += delta
        weight -= delta
    return (weight != start).float().mean().item()


def main() -> None:
    print(
        f"merge/unmerge in bf16: 100 pairs change {100 * merge_drift():.1f}% of a [1024, 1024] matrix's "
        "entries (our merged push writes copies: 0%)"
    )
    from trapo.commands.toy import build_assets
    from trapo.config import ToyConfig

    assets = tempfile.mkdtemp(prefix="bench-lora-toy-")
    tokenizer = str(build_assets(ToyConfig(dir=assets, sft_steps=1), log=lambda m: None) / "model")
    gib = 2**30
    for shape_name, shape in SHAPES.items():
        model_dir = make_model(shape, tokenizer)
        print(
            f"\n{shape_name}: update, {WORLD} ranks on CPU, {SEQS} sequences of 64-128 tokens per rank, "
            f"{DTYPES[shape_name]}"
        )
        print(f"{'set-up':9s} {'trainable':>12s} {'RSS built GiB':>14s} {'RSS peak GiB':>13s} {'update s':>9s}")
        rows = {}
        for setup in SETUPS:
            rows[setup] = trainable, built, peak, sec = run_update(model_dir, setup, DTYPES[shape_name])
            print(f"{setup:9s} {trainable:12,d} {built / gib:14.2f} {peak / gib:13.2f} {sec:9.3f}")
        full, z3, z2 = rows["full"], rows["lora-z3"], rows["lora-z2"]
        print(
            f"lora-z3 / full: update time {z3[3] / full[3]:.2f}, peak RSS {z3[2] / full[2]:.2f}; "
            f"lora-z3 / lora-z2: update time {z3[3] / z2[3]:.2f}, peak RSS {z3[2] / z2[2]:.2f}"
        )
        print(f"{shape_name}: push after an update, 1 rank, vLLM on CPU (rank {RANK}, all 7 projections)")
        pushes = {method: run_push(model_dir, method, DTYPES[shape_name]) for method in ("merged", "adapter")}
        for method, (push, generate) in pushes.items():
            print(f"  {method:8s} push {push:7.3f} s   generation round (64 x 16 tokens) {generate:7.3f} s")
        (mp, mg), (ap, ag) = pushes["merged"], pushes["adapter"]
        print(f"  adapter/merged: push {ap / mp:.3g}x, generation {ag / mg:.3g}x")
        shutil.rmtree(model_dir, ignore_errors=True)
    shutil.rmtree(assets, ignore_errors=True)


if __name__ == "__main__":
    main()
