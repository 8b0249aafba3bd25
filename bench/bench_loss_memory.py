"""Peak memory and speed of the loss head: chunked with recomputation (ours) vs full logits (naive).

The loss head is everything after the final hidden states: the LM head
projection, log-prob of the sampled tokens and entropy, forward + backward,
with the trainer's update loss (entropy bonus 0.01):
    loss = -(logprob * adv).mean() - 0.01 * entropy.mean()
  naive: nn.Linear head -> full [T, V] logits -> .float() -> token_logprobs & token_entropy
  ours:  trapo.algorithm.logits.lm_head_token_stats (chunks of --chunk rows, recomputed in backward,
         the weight gradient summed in place into one [V, H])

Each variant runs in a fresh subprocess (1 thread) that reads its peak RSS
(VmHWM); a baseline subprocess allocates only the head's weight, a
weight-sized gradient and the inputs (hidden [T, H], targets, advantages), and
its peak is subtracted. The weight's gradient starts as None in every pass, as
with `zero_grad(set_to_none=True)` and under ZeRO-3 (which hands each gradient
off after it is accumulated), so the pass's own gradient is the one the
baseline counts.

The memory pass at --tokens runs first and is also the warm-up; then the
peak is reset (/proc/self/clear_refs) and --repeats timed passes run on the
first --time-tokens rows (ms per 1K tokens: their median; a full pass at
T = 2,048 is ~7-9 TFLOP of matmuls, minutes on one core). Their peak gives a
second point: the projection to --project-to tokens is the straight line
through the two peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trapo import runtime  # noqa: E402

runtime.configure()

import torch  # noqa: E402

from trapo.algorithm.logits import DEFAULT_CHUNK_TOKENS, lm_head_token_stats, token_entropy, token_logprobs  # noqa: E402

VARIANTS = ("naive", "ours")
MB = 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("VmHWM not found in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), to measure a second, smaller pass's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_inputs(
    tokens: int, hidden: int, vocab: int
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head (fp32 [V, H], every page touched) and inputs hidden [T, H], targets [T], adv [T].

    The weight is filled from a small random block, row slice by row slice: a
    full randn would take longer than the passes, and a temporary the size of
    the weight would raise the baseline's peak.
    """
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device="meta").to_empty(device="cpu")
    head.requires_grad_(True)
    block = torch.randn(4096, hidden, generator=gen) / hidden**0.5
    with torch.no_grad():
        for start in range(0, vocab, block.shape[0]):
            rows = head.weight[start : start + block.shape[0]]
            rows.copy_(block[: rows.shape[0]])
    # Unit-scale hidden states: logits of std ~1, a realistic softmax.
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    adv = torch.randn(tokens, generator=gen)
    return head, h, targets, adv


def naive_stats(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, chunk: int):
    """The trainer's pre-existing path: full logits, then the per-position functions."""
    logits = head(h).float()[None]  # [1, T, V]
    return token_logprobs(logits, targets[None])[0], token_entropy(logits)[0]


def ours_stats(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, chunk: int):
    s = lm_head_token_stats(h, head, targets, chunk_tokens=chunk, entropy=True)
    return s.logprobs, s.entropy


def one_pass(stats_fn, head, h, targets, adv, chunk: int, n: int) -> float:
    """Forward + backward of the update loss on the first n tokens; returns seconds."""
    head.weight.grad = None  # set_to_none, as the optimizer's zero_grad does
    h.grad = None
    start = time.perf_counter()
    logprob, entropy = stats_fn(head, h[:n], targets[:n], chunk)
    loss = -(logprob * adv[:n]).mean() - 0.01 * entropy.mean()
    loss.backward()
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> dict:
    head, h, targets, adv = make_inputs(args.tokens, args.hidden, args.vocab)
    if args.child == "baseline":
        grad = torch.empty_like(head.weight).fill_(0.0)  # stands for the gradient every pass creates
        del grad
        return {"peak_mb": peak_rss_mb()}
    stats_fn = naive_stats if args.child == "naive" else ours_stats
    big_s = one_pass(stats_fn, head, h, targets, adv, args.chunk, args.tokens)  # the memory pass, also the warm-up
    peak = peak_rss_mb()
    reset_peak_rss()
    n = args.time_tokens
    times = [one_pass(stats_fn, head, h, targets, adv, args.chunk, n) for _ in range(args.repeats)]
    return {
        "peak_mb": peak,
        "peak_small_mb": peak_rss_mb(),
        "ms_per_1k": 1000 * statistics.median(times) / n * 1000,
        "big_ms_per_1k": 1000 * big_s / args.tokens * 1000,
    }


def run_child(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind]
    for key in ("tokens", "time_tokens", "repeats", "vocab", "hidden", "chunk"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(cmd, env=runtime.subprocess_env(), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} subprocess failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="T of the memory pass")
    p.add_argument("--time-tokens", type=int, default=2 * DEFAULT_CHUNK_TOKENS, help="T of the timed passes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--project-to", type=int, default=8192)
    p.add_argument("--child", choices=("baseline", *VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.time_tokens > args.tokens:
        p.error("--time-tokens must not exceed --tokens")
    if args.child:
        print(json.dumps(child(args)))
        return

    wall = time.perf_counter()
    base = run_child("baseline", args)["peak_mb"]
    res = {kind: run_child(kind, args) for kind in VARIANTS}
    weight_mb = args.vocab * args.hidden * 4 / MB
    logits_mb = args.tokens * args.vocab * 4 / MB
    print(
        f"loss head fwd+bwd, fp32 CPU, 1 thread: T={args.tokens}, V={args.vocab}, H={args.hidden}, "
        f"ours chunk={args.chunk} tokens"
    )
    print(
        f"baseline peak {base:.0f} MB (weight {weight_mb:.0f} MB + its gradient + inputs); "
        f"one fp32 [T, V] = {logits_mb:.0f} MB, one [chunk, V] = {args.chunk * args.vocab * 4 / MB:.0f} MB"
    )
    print(
        f"{'':6s} {'peak MB above baseline':>22s} {'x [T,V]':>8s} {'ms / 1K tok':>12s} "
        f"{'(at T=' + str(args.tokens) + ')':>12s} {'proj. T=' + str(args.project_to) + ' MB':>16s}"
    )
    above = {}
    for kind in VARIANTS:
        r = res[kind]
        above[kind] = r["peak_mb"] - base
        small = r["peak_small_mb"] - base
        slope = (above[kind] - small) / (args.tokens - args.time_tokens) if args.tokens > args.time_tokens else 0.0
        projected = above[kind] + slope * (args.project_to - args.tokens)
        print(
            f"{kind:6s} {above[kind]:22.0f} {above[kind] / logits_mb:8.2f} {r['ms_per_1k']:12.0f} "
            f"{r['big_ms_per_1k']:12.0f} {projected:16.0f}"
        )
    print(
        f"(ms / 1K tok: median of {args.repeats} passes at T={args.time_tokens} after a warm-up; "
        f"projection: line through the peaks at T={args.time_tokens} and T={args.tokens}; "
        f"bench wall time {time.perf_counter() - wall:.0f} s)"
    )
    print(f"loss head peak memory ratio ours/naive: {above['ours'] / above['naive']:.3f}")


if __name__ == "__main__":
    main()
