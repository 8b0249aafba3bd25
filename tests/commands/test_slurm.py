"""configs/slurm/train.sbatch with a stand-in `scontrol` (no Slurm here): the hostfile and launch it prints in a dry
run, and a real toy job on this machine that gets Slurm's time-limit signal, saves, exits 75 and requeues itself."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from toyrun import ROOT, TOY

from trapo import runtime

SCRIPT = os.path.join(ROOT, "configs", "slurm", "train.sbatch")
SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $FAKE_NODES; else echo "scontrol $*" >> "$FAKE_SCONTROL_LOG"; fi
"""


def slurm_env(tmp_path: Path, nodes: str, gpus: str, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    env = runtime.subprocess_env(**extra)
    env["PATH"] = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), env["PATH"]])
    env.update(FAKE_NODES=nodes, FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"), SLURM_JOB_NODELIST="n[01-02]",
               SLURM_GPUS_ON_NODE=gpus, SLURM_JOB_ID="4242")  # fmt: skip
    return env


def test_dry_run_prints_the_hostfile_and_the_resuming_launch(tmp_path):
    env = slurm_env(tmp_path, "node01 node02", "8", TRAPO_DRY_RUN="1")
    out = subprocess.run(["bash", SCRIPT, "rollout.n=16"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["node01 slots=8", "node02 slots=8"]
    launch = lines[2].split()
    assert launch[:5] == ["deepspeed", "--hostfile", "outputs/hostfile-4242", "--master_addr", "node01"]
    assert launch[5] == "--master_port" and 1024 <= int(launch[6]) < 65536
    assert launch[7:] == [
        "trapo_train.py",
        "--config",
        "configs/trapo_1k_3k.yaml",
        "resume_from=latest",
        "rollout.n=16",
    ]
    # one node: local ranks, no hostfile (DeepSpeed would want ssh to it)
    env["FAKE_NODES"] = "node07"
    one = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True).stdout.splitlines()
    assert one[0] == "node07 slots=8" and one[1].split()[:3] == ["deepspeed", "--num_gpus", "8"]
    # outside an allocation: one line
    del env["SLURM_JOB_NODELIST"]
    out = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "not inside a Slurm allocation" in out.stderr


@pytest.mark.toy_run
def test_time_limit_signal_saves_exits_75_and_requeues(toy_dir, tmp_path):
    env = slurm_env(tmp_path, "localhost", "2", CONFIG="configs/toy.yaml")
    args = [f"toy.dir={toy_dir}", *TOY, f"output_dir={tmp_path / 'runs'}", "train.rollout_batch_size=16",
            "train.update_batch_size=16", "max_steps=8", "save_steps=0", "progress_bar=false"]  # fmt: skip
    job = subprocess.Popen(["bash", SCRIPT, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # fmt: skip
    rows = tmp_path / "runs" / "toy" / "metrics.jsonl"
    deadline = time.time() + 300
    while not rows.is_file() and time.time() < deadline and job.poll() is None:
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@600, to the batch script alone
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 75, out[-3000:]
    stopped = len(rows.read_text().splitlines())
    assert 1 <= stopped < 8 and f"stopped by a signal after step {stopped}" in out
    assert (tmp_path / "runs" / "toy" / "checkpoints" / f"step-{stopped}").is_dir()
    assert (tmp_path / "scontrol.log").read_text() == "scontrol requeue 4242\n"
