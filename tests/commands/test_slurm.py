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


# Slurm's own scontrol on a malformed list ('gpu[01-02]x'): "Invalid hostlist" on stderr, no host, exit status 0
BAD_SCONTROL = """#!/bin/bash
echo "Invalid hostlist: $3" >&2
"""


def slurm_env(tmp_path: Path, nodes: str, gpus: str, scontrol: str = SCONTROL, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(scontrol)
    (bin_dir / "scontrol").chmod(0o755)
    env = runtime.subprocess_env(**extra)
    env["PATH"] = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), env["PATH"]])
    env.update(
        FAKE_NODES=nodes,
        FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        SLURM_JOB_NODELIST="n[01-02]",
        SLURM_JOB_NUM_NODES=str(len(nodes.split())),
        SLURM_GPUS_ON_NODE=gpus,
        SLURM_JOB_ID="4242",
    )
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
    env.update(FAKE_NODES="node07", SLURM_JOB_NUM_NODES="1")
    one = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True).stdout.splitlines()
    assert one[0] == "node07 slots=8" and one[1].split()[:3] == ["deepspeed", "--num_gpus", "8"]
    # outside an allocation: one line
    del env["SLURM_JOB_NODELIST"]
    out = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "not inside a Slurm allocation" in out.stderr


def test_a_malformed_host_list_stops_in_one_line_before_the_hostfile(tmp_path):
    env = slurm_env(tmp_path, "", "8", scontrol=BAD_SCONTROL, TRAPO_DRY_RUN="1")
    env.update(SLURM_JOB_NODELIST="gpu[01-02]x", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4343")
    out = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("train.sbatch: the host list"), out.stderr
    assert "SLURM_JOB_NODELIST='gpu[01-02]x' gives 0 host(s)" in out.stderr
    assert "Invalid hostlist: gpu[01-02]x" in out.stderr and "expected 2 (SLURM_JOB_NUM_NODES)" in out.stderr
    assert not os.path.exists(os.path.join(ROOT, "outputs", "hostfile-4343"))  # nothing written, nothing launched


def test_a_host_count_other_than_the_jobs_node_count_stops_in_one_line(tmp_path):
    env = slurm_env(tmp_path, "node01 node02", "8", TRAPO_DRY_RUN="1")
    env.update(SLURM_JOB_NUM_NODES="3", SLURM_JOB_ID="4344")
    out = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert "SLURM_JOB_NODELIST='n[01-02]' gives 2 host(s)" in out.stderr and "expected 3" in out.stderr
    assert not os.path.exists(os.path.join(ROOT, "outputs", "hostfile-4344"))
    # no node count in the environment (run by hand): any non-empty list is taken
    del env["SLURM_JOB_NUM_NODES"]
    env["SLURM_JOB_ID"] = "4242"  # the hostfile the dry run above writes
    out = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines()[:2] == ["node01 slots=8", "node02 slots=8"], out.stderr


@pytest.mark.toy_run
def test_time_limit_signal_saves_exits_75_and_requeues(toy_dir, tmp_path):
    env = slurm_env(tmp_path, "localhost", "2", CONFIG="configs/toy.yaml")
    args = [
        f"toy.dir={toy_dir}",
        *TOY,
        f"output_dir={tmp_path / 'runs'}",
        "train.rollout_batch_size=16",
        "train.update_batch_size=16",
        "max_steps=8",
        "save_steps=0",
        "progress_bar=false",
    ]
    job = subprocess.Popen(
        ["bash", SCRIPT, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # another job's rank on the same node, which the signal must not reach
    decoy = [sys.executable, "-c", "import time; time.sleep(600)", "trapo_train.py --local_rank=0"]
    other = subprocess.Popen(decoy, start_new_session=True)
    rows = tmp_path / "runs" / "toy" / "metrics.jsonl"
    deadline = time.time() + 300
    while not rows.is_file() and time.time() < deadline and job.poll() is None:
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@600, to the batch script alone
    out, _ = job.communicate(timeout=300)
    alive = other.poll() is None
    other.kill()
    other.wait()
    assert alive, "the time-limit signal reached another job's rank"
    assert job.returncode == 75, out[-3000:]
    stopped = len(rows.read_text().splitlines())
    assert 1 <= stopped < 8 and f"stopped by a signal after step {stopped}" in out
    assert (tmp_path / "runs" / "toy" / "checkpoints" / f"step-{stopped}").is_dir()
    assert (tmp_path / "scontrol.log").read_text() == "scontrol requeue 4242\n"
