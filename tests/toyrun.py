"""Toy training runs for the tests: each run is a subprocess (a trainer owns a process: its distributed world
and its vLLM engine), launched like a user does (`trapo_train.py`, or the `deepspeed` launcher for 2 ranks)."""

import json
import os
import subprocess
import sys

from trapo import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIO = os.path.join(ROOT, "tests", "scripts", "scenario.py")
STRAIGHT = dict(mode="trapo", max_steps=4, save_steps=2)  # the uninterrupted reference of the resume tests
# as conftest's toy_dir: the schema's warm start (constant rate, no noise), not configs/toy.yaml's longer one
TOY = [
    "toy.labeled=16",
    "toy.unlabeled=48",
    "toy.test=16",
    "toy.sft_steps=150",
    "toy.sft_schedule=constant",
    "toy.sft_noise=0",
]
VLLM = {"rollout.backend": "vllm"}  # for the tests of what vLLM does (the push, sleep, its engines, its resume)


def overrides(toy_dir, out, **kv):
    base = {
        "output_dir": str(out),
        "progress_bar": "false",
        "train.rollout_batch_size": 16,
        "train.update_batch_size": 16,
        "selection.warmup_epochs": 1,
        "save_steps": 0,
        "keep_checkpoints": "null",
        # The hf backend starts in half the time; a test of what vLLM does passes VLLM (its own runs and resume
        # stay covered: the push, sleep and offload, tensor parallelism, two ranks and two nodes, LoRA, a hub model).
        "rollout.backend": "hf",
        # the trainer tests were written with the entropy bonus on (the toy's default before issue 48, now 0):
        # their sequence counts keep zero-advantage sequences, which an entropy_coef of 0 skips
        "loss.entropy_coef": 0.01,
        # configs/toy.yaml scores avg@8 at the start and end of every run; the tests of it ask for it
        "eval.heldout_k": 0,
    }
    base.update(kv)
    return [f"toy.dir={toy_dir}", *TOY, *(f"{k}={v}" for k, v in base.items())]


def run(cmd, timeout=600, env=None):
    env = env or runtime.subprocess_env()
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A port no one listens on now, for a launcher's --master_port: a fixed one can still be held by the
    last run's exiting processes, or by another test's run under `make test`'s two workers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args, nproc=1):
    """The command line of a training run: the script alone for one rank, the `deepspeed` launcher for more."""
    if nproc == 1:
        return [sys.executable, "trapo_train.py", *args]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [launcher, "--num_gpus", str(nproc), "--master_port", str(free_port()), "trapo_train.py", *args]


def train(args, nproc=1, check=True, env=None):
    out = run(command(args, nproc), env=env)
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
