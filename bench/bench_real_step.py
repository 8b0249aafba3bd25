"""What makes a training step of configs/real_smollm2.yaml fast on this CPU, and what memory it takes: the backend,
its threads, LoRA, the update's micro-batch size.

    python bench/bench_real_step.py [--steps 3] [--out FILE]

Each setting is a real run of the trainer (`trapo_train.py --config configs/real_smollm2.yaml`, the same model,
questions, seed, lengths and batch), `--steps` steps with the held-out check off, one setting after the
other on an otherwise idle machine. Per setting: the mean seconds per step and per phase over the steps after
the first (the first pays one-time costs), rollout tokens per second, and the update's seconds per
trained sequence (prompt and response: the update runs the whole sequence; zero-advantage groups are
skipped), and the process's peak resident memory (the kernel's count for that child). `make real-figures` writes
what it prints into docs/real-model.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trapo import runtime  # noqa: E402

# name -> (threads, overrides)
# OMP_NUM_THREADS is the process's threads; the shipped config runs its update on train.update_threads (2).
SETTINGS = {
    "vllm 1 thread, update 2": (1, ["rollout.backend=vllm"]),
    "vllm 1 thread, update 1": (1, ["rollout.backend=vllm", "train.update_threads=null"]),
    "vllm 1/2, 8K micro-batches": (1, ["rollout.backend=vllm", "train.micro_batch_tokens=8192"]),
    "hf, 2 threads": (2, ["rollout.backend=hf"]),
    "hf, 2 threads, LoRA r16": (2, ["rollout.backend=hf", "model.lora.rank=16", "model.lora.alpha=32"]),
}


def run(name: str, threads: int, overrides: list[str], steps: int, out: str) -> dict:
    config = os.path.join(runtime.ROOT, "configs", "real_smollm2.yaml")
    cmd = [sys.executable, os.path.join(runtime.ROOT, "trapo_train.py"), "--config", config, f"max_steps={steps}"]
    cmd += [f"output_dir={out}", f"run_name=run-{abs(hash(name))}", "data.test_files=[]", "progress_bar=false"]
    cmd += ["selection.warmup_epochs=0", *overrides]  # unlabeled questions train from the first step, as later on
    run_dir = os.path.join(out, f"run-{abs(hash(name))}")
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, env=runtime.subprocess_env(OMP_NUM_THREADS=str(threads)), stdout=err, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not every child's so far
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            last = err.read().strip().splitlines()[-1:]
            raise SystemExit(f"{name}: the run failed ({last}); see {run_dir}/log.txt")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    later = rows[1:] or rows
    mean = {p: sum(r["timing"].get(p, 0.0) for r in later) / len(later) for p in ("rollout", "update", "step")}
    trained = sum(r["trained_sequences"] for r in later)
    return {
        **mean,
        "rollout_tok_s": sum(r["response_tokens"] for r in later) / sum(r["timing"]["rollout"] for r in later),
        "update_s_per_seq": sum(r["timing"]["update"] for r in later) / trained if trained else None,
        "trained_sequences": sum(r["trained_sequences"] for r in later) / len(later),
        "peak_gb": usage.ru_maxrss / 2**20,  # ru_maxrss is in KiB on Linux
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="also write the printed lines into this file")
    args = p.parse_args()
    lines = [
        f"a step of configs/real_smollm2.yaml ({args.steps} steps per setting, means over steps 2-{args.steps}):",
        f"{'setting':<28} {'step s':>7} {'rollout s':>9} {'update s':>8} {'rollout tok/s':>13} "
        f"{'update s/seq':>15} {'trained seqs':>12} {'peak GiB':>9}",
    ]
    with tempfile.TemporaryDirectory() as out:
        for name, (threads, overrides) in SETTINGS.items():
            r = run(name, threads, overrides, args.steps, out)
            per_seq = f"{r['update_s_per_seq']:.2f}" if r["update_s_per_seq"] else "-"
            lines.append(
                f"{name:<28} {r['step']:>7.1f} {r['rollout']:>9.1f} {r['update']:>8.1f} {r['rollout_tok_s']:>13.0f} "
                f"{per_seq:>15} {r['trained_sequences']:>12.1f} {r['peak_gb']:>9.1f}"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
