"""Separate rollout ranks against the colocated trainer on this CPU, measured honestly, then a projection.

    python bench/bench_async.py                 # prints the table
    python bench/bench_async.py --write-docs    # and writes it into docs/benchmarks.md (block bench-async)
    python bench/bench_async.py --precision 0 1 [--write-docs]   # selection precision at s = 1, per seed
                                                # (block async-precision of docs/async-rollouts.md)

The toy task (16 labeled + 48 unlabeled questions, 16 a step, G = 8) with forced lengths
(rollout.min_tokens = rollout.max_tokens, so every round costs the same), `--steps` steps, with the hf
backend, then with vLLM (`--backends`):

    colocated, 2 threads      one process, OMP_NUM_THREADS=2: both cores for every phase, one after another
    colocated, 1 thread       one process pinned to core 0: what one core does alone (hf only)
    separate s=0 / s=1        one training process pinned to core 0, one rollout process pinned to core 1
                              (one thread each); s = rollout.max_staleness

Per run: seconds per step (median of the steps after the first), the phases' medians (generate: the
rollout ranks' generation time under separate, the rollout phase when colocated; wait: the trainer's wait
for its round under separate; grade, update, push), and the reward at equal steps (the mean of
reward_labeled over the run). On a machine shared with other work the figures move between runs.

Then the projection for 8 x H100 at the paper's shape: the measured phase shares of the colocated
1-thread run (generation, the rest) scaled to R rollout GPUs and 8 - R training GPUs, the step taking the
longer side at s >= 1 and the sum at s = 0. Arithmetic from this toy's shares, not a GPU measurement (a 7B
step's shares differ); the memory side is `python -m trapo doctor --plan` with rollout.placement=separate.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trapo import runtime  # noqa: E402

BLOCK = "bench-async"
PRECISION_BLOCK = "async-precision"  # in docs/async-rollouts.md


TOY = {"toy.labeled": 16, "toy.unlabeled": 48, "toy.test": 16, "toy.sft_steps": 150}  # over configs/toy.yaml's


def toy_overrides(toy_dir: str) -> list[str]:
    return [f"toy.dir={toy_dir}", *(f"{k}={v}" for k, v in TOY.items())]


def overrides(toy_dir: str, out: str, name: str, steps: int, tokens: int, extra: dict) -> list[str]:
    kv = {
        "output_dir": out,
        "run_name": name,
        "progress_bar": "false",
        "max_steps": steps,
        "save_steps": 0,
        "keep_checkpoints": "null",
        "train.rollout_batch_size": 16,
        "train.update_batch_size": 16,
        "selection.warmup_epochs": 1,
        "rollout.rambling.loop_truncated": "null",  # every answer at the limit is the forcing, not a loop
        "rollout.max_tokens": tokens,
        "rollout.min_tokens": tokens,
        **extra,
    }
    return toy_overrides(toy_dir) + [f"{k}={v}" for k, v in kv.items()]


def launch(args: list[str], *, threads: int, cores: list[str | None]) -> None:
    """One process per entry of `cores` (pinned with taskset when given), ranks in order, as a launcher does."""
    from trapo.engine.dist import free_port

    port, procs = str(free_port()), []
    for rank, core in enumerate(cores):
        env = runtime.subprocess_env(OMP_NUM_THREADS=str(threads))
        env |= dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(cores)), MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = port
        pin = ["taskset", "-c", core] if core is not None else []
        cmd = [*pin, sys.executable, "trapo_train.py", *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"bench_async: a run failed:\n{err.decode()[-3000:]}")


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    med = lambda values: statistics.median(values) if values else 0.0  # noqa: E731
    separate = "rollout_staleness" in rows[0]
    phase = lambda key: med([r["timing"].get(key, 0.0) for r in later])  # noqa: E731
    return {
        "step": phase("step"),
        "generate": med([r["rollout_generate_s"] or 0.0 for r in later]) if separate else phase("rollout"),
        "wait": phase("rollout") if separate else 0.0,
        "grade": phase("grading"),
        "update": phase("update"),
        "push": phase("weight_push"),
        "reward": statistics.mean(r["reward_labeled"] for r in rows),
        "staleness": max(r.get("rollout_staleness", 0) for r in rows),
    }


def projection(col: dict, gpus: int = 8) -> list[str]:
    """Step time relative to colocated on `gpus` GPUs for each split, from the colocated phase shares."""
    gen = col["generate"] / col["step"]
    rest = 1.0 - gen
    lines = [f"projection (arithmetic, not a measurement): {gpus} x H100, generation share {gen:.2f} of a step"]
    for r in (2, 4, 6):
        g, u = gen * gpus / r, rest * gpus / (gpus - r)  # each side on its share of the GPUs
        lines.append(
            f"  {r} rollout + {gpus - r} training GPUs: s=0 {g + u:.2f}x the colocated step, "
            f"s=1 {max(g, u):.2f}x (the longer side)"
        )
    return lines


def precision(seeds: list[int], epochs: int, write: bool) -> None:
    """Selection under staleness: the shipped toy config (configs/toy.yaml, hf backend), colocated against
    separate at rollout.max_staleness 1, per seed: the pseudo-label precision of the selected unlabeled
    questions and their count at each epoch end after the warm-up, and the labeled reward of the last epoch."""
    lines = [
        f"configs/toy.yaml, hf backend, {epochs} epochs (warm-up 3), seeds {seeds}; per epoch end after the warm-up"
    ]
    lines.append(f"{'run':<28} {'precision of selected':>22} {'selected':>9} {'reward, last epoch':>19}")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, extra, cores in (
                ("colocated", {}, [None]),
                (
                    "separate s=1",
                    {"rollout.placement": "separate", "rollout.ranks": 1, "rollout.max_staleness": 1},
                    [None, None],
                ),
            ):
                run = f"{name.split()[0]}-{seed}"
                kv = {
                    "toy.dir": f"{tmp}/toy",
                    "output_dir": tmp,
                    "run_name": run,
                    "progress_bar": "false",
                    "seed": seed,
                    "epochs": epochs,
                    "save_steps": 0,
                    "rollout.backend": "hf",
                    **extra,
                }
                launch([f"{k}={v}" for k, v in kv.items()], threads=1, cores=cores)
                rows = [json.loads(line) for line in (Path(tmp) / run / "metrics.jsonl").read_text().splitlines()]
                ends = [r["selection"] for r in rows if r.get("selection", {}).get("precision_selected") is not None]
                last = [r["reward_labeled"] for r in rows if r["epoch"] == rows[-1]["epoch"]]
                lines.append(
                    f"{name + f', seed {seed}':<28} {statistics.mean(e['precision_selected'] for e in ends):22.3f} "
                    f"{statistics.mean(e['selected'] for e in ends):9.1f} {statistics.mean(last):19.3f}"
                )
    text = "\n".join(lines)
    print(text)
    if write:
        from trapo.commands.readme import replace_block

        page = ROOT / "docs" / "async-rollouts.md"
        page.write_text(replace_block(page.read_text(), PRECISION_BLOCK, f"```\n{text}\n```"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32, help="forced response length (min = max tokens)")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--precision", type=int, nargs="*", metavar="SEED", help="the selection study instead")
    parser.add_argument("--epochs", type=int, default=10, help="--precision: epochs per run")
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    args = parser.parse_args()
    if args.precision is not None:
        return precision(args.precision or [0, 1], args.epochs, args.write_docs)
    from trapo.commands.toy import build_assets
    from trapo.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        toy_dir = str(Path(tmp) / "toy")
        # the toy the runs load (configs/toy.yaml under their toy.* overrides), so that they find it built
        build_assets(load_config(str(ROOT / "configs" / "toy.yaml"), toy_overrides(toy_dir)).toy, log=lambda m: None)
        sep = {"rollout.placement": "separate", "rollout.ranks": 1}
        runs = {}
        for backend in args.backends:
            engine = {"rollout.backend": backend}
            runs[f"{backend} colocated, 2 threads"] = (engine, 2, [None])
            if backend == "hf":  # the projection's phase shares
                runs["hf colocated, 1 thread (core 0)"] = (engine, 1, ["0"])
            runs[f"{backend} separate s=0 (cores 0 + 1)"] = (
                {**engine, **sep, "rollout.max_staleness": 0},
                1,
                ["0", "1"],
            )
            runs[f"{backend} separate s=1 (cores 0 + 1)"] = (
                {**engine, **sep, "rollout.max_staleness": 1},
                1,
                ["0", "1"],
            )
        results = {}
        for i, (name, (extra, threads, cores)) in enumerate(runs.items()):
            launch(overrides(toy_dir, tmp, f"run{i}", args.steps, args.tokens, extra), threads=threads, cores=cores)
            results[name] = summary(Path(tmp) / f"run{i}")
    head = f"{'':<34} {'s/step':>7} {'generate':>9} {'wait':>6} {'grade':>6} {'update':>7} {'push':>6} {'reward':>7}"
    lines = [
        f"toy, 16 questions x G=8 a step, {args.tokens} forced tokens, {args.steps} steps, "
        f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end: other work shares them); "
        f"medians of steps 2..{args.steps}, seconds",
        head,
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<34} {r['step']:7.3f} {r['generate']:9.3f} {r['wait']:6.3f} {r['grade']:6.3f} "
            f"{r['update']:7.3f} {r['push']:6.3f} {r['reward']:7.3f}"
        )
    for backend in args.backends:
        base = results[f"{backend} colocated, 2 threads"]["step"]
        mine = {name: r for name, r in results.items() if name.startswith(backend)}
        speedups = ", ".join(f"{name.split(' (')[0]} {base / r['step']:.2f}x" for name, r in mine.items())
        lines.append(f"  {backend}: speed-up over colocated 2 threads: {speedups}")
    if "hf" in args.backends:
        lines += projection(results["hf colocated, 1 thread (core 0)"])
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        from trapo.commands.readme import replace_block

        page = ROOT / "docs" / "benchmarks.md"
        page.write_text(replace_block(page.read_text(), BLOCK, f"```\n{text}\n```"))


if __name__ == "__main__":
    main()
