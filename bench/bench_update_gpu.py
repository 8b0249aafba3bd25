"""The policy update alone on one GPU: tokens/s, MFU and peak memory, our chunked LM head vs full logits.

DeepSpeed ZeRO-3 on one GPU, bf16, gradient checkpointing (--no-checkpointing: without), packed
micro-batches of `--tokens` tokens (--fused-kernels: model.fused_kernels; --persistent-params: no parameter
released after its forward), on a DeepSeek-R1-Distill-Qwen-1.5B-shaped Qwen2 with random weights (no download,
no vLLM: it runs on a machine with torch, transformers, accelerate and a DeepSpeed wheel plus pydantic).
Each path runs `Policy.update` on the same sequences (`--seqs` of `--length` tokens, a quarter of them
prompt): "ours" is the trainer's path (chunked LM head, no [T, V] logits); "full logits" swaps in a
head that builds the [T, V] logits and their fp32 log-softmax, as a plain implementation does.

    python bench/bench_update_gpu.py                  # on a GPU node
    python bench/bench_update_gpu.py --cpu-smoke      # a tiny shape on CPU: the script runs (no figures)

MFU counts 6 x parameters x tokens per update (the matmuls of forward and backward; attention and the
recomputation of checkpointed layers are not counted) against the GPU's dense bf16 peak (`--peak-tflops`,
989 for an H100/H200 SXM).
"""

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trapo import runtime  # noqa: E402

runtime.configure()  # before torch is imported

import torch  # noqa: E402

from trapo.commands.gpu_check.shape_step import R1_DISTILL_1P5B  # noqa: E402
from trapo.commands.toy import MODEL_SHAPE  # noqa: E402

TINY = dict(vocab_size=320, **MODEL_SHAPE)  # the toy's shape


def full_logits_stats(policy):
    """Policy._token_stats with the [T, V] logits built in full (the path our chunked head replaces)."""
    from trapo.algorithm.logits import TokenStats, scatter_to_mask, token_entropy

    def stats(batch, *, entropy=False, kl_uniform=False, engine=None):
        mask = batch["response_mask"].to(policy.device)
        ids, rows = batch["packed_ids"].to(policy.device), batch["packed_response"].to(policy.device)
        out = policy.engine(
            input_ids=ids,
            position_ids=batch["packed_positions"].to(policy.device),
            attention_mask=None,
            packed_bounds=batch["packed_bounds"],
        )
        logits = out.logits[:, :-1][rows].float() / policy.temperature  # [N, V] in fp32
        logp = logits.log_softmax(-1)
        lp = logp.gather(-1, ids[:, 1:][rows][:, None])[:, 0]
        ent = token_entropy(logits) if entropy else None
        return TokenStats(scatter_to_mask(lp, mask), None if ent is None else scatter_to_mask(ent, mask), None)

    return stats


def update_seconds(policy, seqs, batch: dict, steps: int, gpu: bool) -> float:
    """Median seconds of `steps` `Policy.update` calls on the same sequences, after one warm-up."""
    times = []
    for _ in range(steps + 1):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        policy.update(seqs, 0, batch)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="train.micro_batch_tokens")
    p.add_argument("--seqs", type=int, default=32, help="sequences per update")
    p.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="timed updates per path, after one warm-up")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU, to check the script runs")
    p.add_argument("--no-checkpointing", action="store_true", help="model.gradient_checkpointing=false")
    p.add_argument("--only-ours", action="store_true", help="our path alone: no full-logits path, no packing run")
    p.add_argument(
        "--fused-kernels", action="store_true", help="model.fused_kernels=true (compiled norm, SwiGLU, rotary)"
    )
    p.add_argument(
        "--persistent-params",
        action="store_true",
        help="ZeRO-3 with every parameter persistent (never released after its forward): on one GPU its "
        "partition is the whole model anyway, so this measures what the gather-and-release hooks cost",
    )
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    if not gpu and not args.cpu_smoke:
        raise SystemExit("bench_update_gpu: no CUDA GPU here (use --cpu-smoke to check the script on CPU)")
    if args.cpu_smoke:
        args.tokens, args.seqs, args.length, args.steps = 512, 4, 128, 1

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trapo.config import load_config
    from trapo.engine import dist
    from trapo.engine.batch import TrainSequence
    from trapo.training.settings import open_policy, planned

    dist.init_distributed()
    shape = TINY if args.cpu_smoke else R1_DISTILL_1P5B
    model_dir = tempfile.mkdtemp(prefix="bench-update-gpu-")
    atexit.register(shutil.rmtree, model_dir, True)  # scratch weights: 3.5 GB at the 1.5B shape
    with torch.device("cuda" if gpu else "cpu"):  # random init on the GPU: seconds, not a minute of CPU
        Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16).save_pretrained(model_dir)
    overrides = [
        "model.dtype=bfloat16",
        f"model.gradient_checkpointing={'false' if args.no_checkpointing else 'true'}",
        f"model.fused_kernels={'true' if args.fused_kernels else 'false'}",
        f"train.param_persistence={'true' if args.persistent_params else 'false'}",  # each row says which
        "loss.entropy_coef=0.01",
        f"train.micro_batch_tokens={args.tokens}",
        f"rollout.max_tokens={args.length}",
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), overrides)
    cfg = planned(cfg, model_dir, 1)  # the auto settings as the trainer decides them here
    policy = open_policy(cfg, model_dir, 1, 0)
    params = sum(getattr(q, "ds_numel", q.numel()) for q in policy.model.parameters())
    g = torch.Generator().manual_seed(0)
    prompt = args.length // 4
    draw = [torch.randint(3, shape["vocab_size"], (args.length,), generator=g).tolist() for _ in range(args.seqs)]
    seqs = [
        TrainSequence(ids, prompt, advantage=1.0 if i % 2 else -1.0, weight=1.0, labeled=True)
        for i, ids in enumerate(draw)
    ]
    batch = {"sequences": len(seqs), "tokens": len(seqs) * (args.length - prompt)}
    tokens = sum(len(s.ids) for s in seqs)
    ours = policy._token_stats
    rows = []
    paths = [("ours (chunked head)", ours)] + ([] if args.only_ours else [("full logits", full_logits_stats(policy))])
    for name, stats in paths:
        policy._token_stats = stats
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sec = update_seconds(policy, seqs, batch, args.steps, gpu)
        peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
        mfu = 6 * params * tokens / sec / (args.peak_tflops * 1e12)
        rows.append((name, tokens / sec, mfu, peak, sec))
    device = torch.cuda.get_device_name(0) if gpu else "CPU (smoke run: not a measurement)"
    settings = ["no gradient checkpointing" if args.no_checkpointing else "gradient checkpointing"]
    settings += ["fused kernels"] * args.fused_kernels + ["parameters persistent"] * args.persistent_params
    print(
        f"{device}; {params / 1e9:.2f}B parameters; {args.seqs} x {args.length} tokens per update, "
        f"micro_batch_tokens {args.tokens}, bf16, ZeRO-3, {', '.join(settings)}"
    )
    print(f"{'path':22s} {'tokens/s':>10s} {'MFU':>6s} {'peak GiB':>9s} {'s/update':>9s}")
    for name, tps, mfu, peak, sec in rows:
        print(f"{name:22s} {tps:10.0f} {mfu:6.1%} {peak:9.2f} {sec:9.3f}")
    if not args.only_ours:
        print(
            f"peak memory ours/full logits: {rows[0][3] / rows[1][3]:.2f}; time ours/full logits: "
            f"{rows[0][4] / rows[1][4]:.2f}"
        )
    policy._token_stats = ours
    plan_line(cfg, model_dir, rows[0][3], gpu)
    if not args.only_ours:
        packing_vs_padding(policy, cfg, shape, args, gpu)


def plan_line(cfg, model_dir: str, measured_gib: float, gpu: bool) -> None:
    """The memory plan's update phase for this shape and micro-batch, beside the measured peak."""
    import json
    from pathlib import Path

    from trapo.engine.memory_plan import memory_plan
    from trapo.engine.model_shapes import model_arch

    if not gpu:
        print("memory plan: (GPU only)")
        return
    ds_config = json.loads(Path(ROOT, cfg.train.deepspeed_config).read_text())
    plan = memory_plan(cfg, 1, torch.cuda.get_device_properties(0).total_memory, model_arch(model_dir), ds_config)
    planned = plan.peak("update") / 2**30
    print(
        f"memory plan, update phase: {planned:.2f} GiB planned, {measured_gib:.2f} GiB measured "
        f"(measured/planned {measured_gib / planned:.2f})"
    )


def packing_vs_padding(policy, cfg, shape: dict, args, gpu: bool) -> None:
    """Sequences of mixed lengths (a quarter to all of --length), packed rows vs right-padded micro-batches:
    the same update, tokens/s of each and which attention kernel the packed rows ran."""
    import dataclasses

    from trapo.engine import attention
    from trapo.engine.batch import TrainSequence

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.length // 4, args.length + 1, (args.seqs,), generator=g).tolist()
    seqs = [
        TrainSequence(
            torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist(),
            n // 4,
            advantage=1.0 if i % 2 else -1.0,
            weight=1.0,
            labeled=True,
        )
        for i, n in enumerate(lengths)
    ]
    batch = {"sequences": len(seqs), "tokens": sum(n - n // 4 for n in lengths)}
    speed = {}
    for packed in (True, False):
        policy.train_cfg = dataclasses.replace(cfg.train, packing=packed)
        speed[packed] = sum(lengths) / update_seconds(policy, seqs, batch, args.steps, gpu)
    policy.train_cfg = cfg.train
    why = f" ({attention.KERNEL['why']})" if attention.KERNEL["why"] else ""
    print(f"packed rows ran: {attention.KERNEL['name']}{why}")
    print(
        f"mixed lengths {min(lengths)}-{max(lengths)}: packed {speed[True]:.0f} tokens/s, padded "
        f"{speed[False]:.0f} tokens/s, packed/padded {speed[True] / speed[False]:.2f}"
    )


if __name__ == "__main__":
    main()
