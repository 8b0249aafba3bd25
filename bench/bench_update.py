"""The policy update's work: today's path vs packing vs packing + rank balancing, side by side.

Two ranks on CPU (gloo, one thread each), DeepSpeed ZeRO-3, a toy-shaped Qwen2 with random weights,
one update batch per rank of 8 questions x 8 responses whose lengths follow a long-tailed
(lognormal, 16 to 1,024 tokens) distribution drawn per rank with a fixed seed, and a third of the
groups with equal rewards (advantage 0). Loss: Dr.GRPO without entropy or KL terms, so a zero-advantage
sequence cannot change the gradient. Paths, all through `Policy.update` as the trainer calls it:

- today:           right-padded micro-batches, each rank its own rollouts, every sequence computed;
- packed:          padding-free packed rows (trapo/engine/packing.py), each rank its own rollouts;
- packed+balanced: packed, zero-advantage sequences skipped, tokens balanced across ranks (the defaults).

Prints computed tokens, update_efficiency (signal tokens / tokens computed by all ranks) with its
parts, and the median wall time of an update (7 per path, taking turns, after a warm-up), then the
efficiency a paper-scale run would get (8 ranks, the same distribution scaled to 8,192 tokens,
micro_batch_tokens 16,384) from the pure function alone.
Targets: efficiency >= 0.95, update >= 1.3x faster than today's.
Run: make bench (or .venv/bin/python bench/bench_update.py).
"""

import atexit
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trapo import runtime  # noqa: E402

runtime.configure()  # bounded threads before torch is imported

WORLD, QUESTIONS, G, BUDGET, REPEATS = 2, 8, 8, 2048, 7
PATHS = {
    "today": dict(packing=False, balance_ranks=False, skip_zero_advantage=False),
    "packed": dict(packing=True, balance_ranks=False, skip_zero_advantage=False),
    "packed+balanced": dict(packing=True, balance_ranks=True, skip_zero_advantage=None),
}


def lengths(rng: random.Random, n: int, scale: float = 1.0) -> list[tuple[int, int]]:
    """(prompt, response) token counts: responses lognormal around ~100 tokens, clipped to [16, 1024]."""
    return [
        (rng.randrange(8, 40), int(min(1024, max(16, int(rng.lognormvariate(4.6, 0.9)))) * scale)) for _ in range(n)
    ]


def rank_batch(rank: int, scale: float = 1.0) -> list[tuple[int, int, float]]:
    """This rank's (prompt, response, advantage) per sequence: 8 groups of G, a third with advantage 0."""
    rng = random.Random(1000 + rank)
    out = []
    for _ in range(QUESTIONS):
        zero = rng.random() < 1 / 3
        out += [(p, r, 0.0 if zero else rng.choice([-0.5, 0.5])) for p, r in lengths(rng, G, scale)]
    return out


def worker(rank: int, port: int, model_dir: str, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import dataclasses

    import torch

    from trapo.algorithm.loss import PolicyLoss
    from trapo.config import load_config
    from trapo.engine import dist
    from trapo.engine.attention import ATTENTION
    from trapo.engine.batch import TrainSequence
    from trapo.engine.packing import update_efficiency
    from trapo.training.settings import loss_spec, open_policy, planned

    dist.init_distributed()
    torch.manual_seed(rank)
    seqs = [
        TrainSequence([int(x) for x in torch.randint(3, 300, (p + r,))], p, advantage=a, weight=1.0, labeled=True)
        for p, r, a in rank_batch(rank)
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), ["loss.entropy_coef=0.0"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_tokens=BUDGET))
    cfg = planned(cfg, model_dir, WORLD)  # the auto settings as the trainer decides them here
    policy = open_policy(cfg, model_dir, WORLD, 0)
    batch = dist.all_sum({"sequences": len(seqs), "tokens": sum(len(s.ids) - s.prompt_len for s in seqs)})
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    works = {}
    for _ in range(REPEATS + 1):  # the paths take turns, so a slow spell of the machine hits all; first: warm-up
        for name, switches in PATHS.items():
            policy.train_cfg = dataclasses.replace(cfg.train, **switches)
            run_cfg = dataclasses.replace(cfg, train=policy.train_cfg)  # train.skip_zero_advantage is the loss's rule
            policy.loss = PolicyLoss(loss_spec(run_cfg), WORLD, on_gpu=torch.cuda.is_available())
            policy.model.set_attn_implementation(ATTENTION if switches["packing"] else "sdpa")
            dist.barrier()
            start = time.perf_counter()
            part = policy.trainable(seqs)
            if switches["balance_ranks"]:
                part = policy.balance(part)
            _, _, works[name] = policy.update(part, 0, batch)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    results = {
        name: (statistics.median(times[name][1:]), works[name], update_efficiency(works[name])) for name in PATHS
    }
    if rank == 0:
        queue.put(results)


def paper_scale() -> dict[str, float]:
    """8 ranks x 64 sequences, lengths x 8 (to 8,192), micro_batch_tokens 16,384: the pure function alone."""
    from trapo.engine.batch import pack_by_tokens
    from trapo.engine.packing import balance, pack_rows, update_efficiency, work_counts

    ranks = [rank_batch(r, scale=8.0) for r in range(8)]
    signal = sum(p + r for b in ranks for p, r, a in b if a != 0.0)
    today = [
        [[ranks[k][i][0] + ranks[k][i][1] for i in g] for g in pack_by_tokens([p + r for p, r, _ in ranks[k]], 16384)]
        for k in range(8)
    ]
    kept = [[p + r for p, r, a in b if a != 0.0] for b in ranks]
    mine = [[kept[src][i] for src, i in plan] for plan in balance(kept)]
    new = [[[mine[k][i] for i in g] for g in pack_rows(mine[k], 16384)] for k in range(8)]
    return {
        "today": update_efficiency(work_counts(today, signal, packed=False))["update_efficiency"],
        "new": update_efficiency(work_counts(new, signal, packed=True))["update_efficiency"],
    }


def main() -> None:
    import multiprocessing

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trapo.commands.toy import MODEL_SHAPE

    model_dir = tempfile.mkdtemp(prefix="bench-update-")
    atexit.register(shutil.rmtree, model_dir, True)  # scratch weights
    config = Qwen2Config(vocab_size=320, **MODEL_SHAPE)  # the toy's shape
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, model_dir, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = queue.get(timeout=1800)
    for p in procs:
        p.join()
    print(
        f"{WORLD} ranks on CPU, toy-shaped model, {QUESTIONS} questions x {G} per rank, lognormal 16-1,024 tokens, "
        f"micro_batch_tokens {BUDGET}:"
    )
    print(
        f"{'path':16s} {'computed':>9s} {'signal':>7s} {'efficiency':>10s} {'padding':>8s} {'imbalance':>9s} "
        f"{'zero-adv':>8s} {'update s':>9s}"
    )
    for name, (sec, work, eff) in results.items():
        shares = f"{eff['padding_share']:8.3f} {eff['imbalance_share']:9.3f} {eff['zero_signal_share']:8.3f}"
        print(
            f"{name:16s} {work['computed']:9d} {work['signal']:7d} {eff['update_efficiency']:10.3f} {shares} {sec:9.3f}"
        )
    paper = paper_scale()
    print(
        f"paper scale (8 ranks, up to 8,192 tokens, micro_batch_tokens 16,384), pure function: "
        f"today {paper['today']:.3f}, packed+balanced {paper['new']:.3f}"
    )
    e0, e1 = results["today"][2]["update_efficiency"], results["packed+balanced"][2]["update_efficiency"]
    ratio = results["today"][0] / results["packed+balanced"][0]
    print(
        f"targets: efficiency >= 0.95 {'met' if e1 >= 0.95 else 'MISSED'}; "
        f"update >= 1.3x faster {'met' if ratio >= 1.3 else 'MISSED'}"
    )
    print(f"update efficiency: today {e0:.3f}, packed+balanced {e1:.3f}; update time today/new {ratio:.2f}")


if __name__ == "__main__":
    main()
