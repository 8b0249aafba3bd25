"""Toy training runs for the tests: each run is a process per rank (a trainer owns a process: its distributed
world and its vLLM engine), set up as a user's `python trapo_train.py` or the `deepspeed` launcher's ranks are,
forked from a process that has done a trainer's imports already (tests/forking/servers.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trapo import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIO = os.path.join(ROOT, "tests", "scripts", "scenario.py")
STRAIGHT = dict(mode="trapo", max_steps=4, save_steps=2)  # the uninterrupted reference of the resume tests
# as conftest's toy_dir: the schema's warm start (constant rate 3e-3, no noise), not configs/toy.yaml's longer
# one; a setting left out here would be configs/toy.yaml's, and every run would build its own toy
TOY = [
    "toy.labeled=16",
    "toy.unlabeled=48",
    "toy.test=16",
    "toy.sft_steps=150",
    "toy.sft_lr=0.003",
    "toy.sft_schedule=constant",
    "toy.sft_noise=0",
]
# it blocks vLLM's import, where the pre-imported parent has made it: a fresh interpreter only
FRESH = {os.path.join(ROOT, "tests", "scripts", "without_vllm.py")}
VLLM = {"rollout.backend": "vllm"}  # for the tests of what vLLM does (the push, sleep, its engines, its resume)
VLLM_RUN = dict(mode="trapo", max_steps=8, save_steps=4, **VLLM)  # conftest's vllm_run: colocated vLLM, 8 steps


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
    """`cmd` to its end, output captured. Python scripts and `python -m trapo` commands are forked from a
    pre-imported parent (`_server`) where the environment allows; other programs start afresh, as does a script
    that changes what can be imported (`FRESH`)."""
    env = env or runtime.subprocess_env()
    server = _server(env) if _forkable(cmd) else None
    if server is None:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return server.run(cmd[1:], env, timeout=timeout)


def start(cmd, env=None):
    """`cmd` started, its output discarded, leading a process group of its own: os.killpg(p.pid, sig) reaches it and
    what it started (a sweep's runs, which stay in its group). Forked where `run` would fork it."""
    env = env or runtime.subprocess_env()
    server = _server(env) if _forkable(cmd) else None
    if server is None:
        out = subprocess.DEVNULL
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)
    with open(os.devnull, "w") as null:
        return server.start(cmd[1:], env, null, null, 0)


def _forkable(cmd):
    script = cmd[1].endswith(".py") and os.path.join(ROOT, cmd[1]) not in FRESH  # relative to ROOT, as run there
    return cmd[0] == sys.executable and (script or cmd[1:3] == ["-m", "trapo"])


def free_port() -> int:
    """A port no one listens on now, nor on the next one, for a launcher's --master_port (a separate run's
    rollout link listens on MASTER_PORT + 1): a fixed one can still be held by the last run's exiting
    processes, or by another test's run under `make test`'s two workers."""
    import socket

    while True:
        with socket.socket() as s, socket.socket() as after:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                after.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


_SERVERS = []


def start_server():
    """This pytest process's pre-imported parent for the suite's own environment, started now: its imports overlap
    the toy's build (or the wait for another worker's), and the first of the many runs in that environment forks."""
    pool = _pool()
    if pool is not None:
        pool.prestart(runtime.subprocess_env())


def _server(env):
    """The pre-imported parent (tests/forking/servers.py) of this pytest process for a child in `env`, or None:
    start the child afresh. None with TRAPO_TESTS_FORK=0, and on a GPU machine, where a fork after CUDA's start-up
    (an import may start it) is unsafe. The suite's own environment's parent starts with the toy's build
    (`start_server`); another environment's starts at its second child: the environment of an in-process test's
    runs changes with what it imported (tensorboardX sets CRC32C_SW_MODE) and with what it sets itself
    (HF_HUB_CACHE), and one used once is cheaper fresh."""
    pool = _pool()
    return None if pool is None else pool.server(env)


def _pool():
    if os.environ.get("TRAPO_TESTS_FORK", "1") == "0" or runtime.has_gpu():
        return None
    if not _SERVERS:
        from forking.servers import LAUNCHER_VARS, ForkServers

        from trapo import faults

        # a run's environment may differ from its parent's in the launcher's variables, the test's name and the
        # fault a test switches on (read at run time: trapo/faults.py)
        per_run = LAUNCHER_VARS | {"PYTEST_CURRENT_TEST", faults.VARIABLE}
        _SERVERS.append(ForkServers(ROOT, per_run, fresh_first=1))
    return _SERVERS[0]


class Ranks:
    """The processes of one training run: rank r runs `python -u trapo_train.py ARGS --local_rank=r` in the
    environment the `deepspeed` launcher gives its ranks (deepspeed/launcher/launch.py of 0.19.8: MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE, CROSS_RANK, CROSS_SIZE, LOCAL_SIZE, RANK, LOCAL_RANK), started without the
    launcher's two front processes, each of which imports DeepSpeed (what the launcher itself does is tested
    where it matters, with the user's trapo_train.py: two nodes, SIGTERM to a deepspeed job, Slurm). As its
    launch.py, the first rank to fail has the others terminated and gives the run's exit code. The ranks share
    one process group, led by rank 0 (`pgid`): os.killpg(ranks.pgid, sig) reaches them all, as a signal to a
    launched job does. Each rank is forked from this pytest process's pre-imported parent (`_server`), which
    imported torch, transformers, DeepSpeed and vLLM once, where the environment allows; TRAPO_TESTS_FORK=0
    starts every rank afresh. `script` replaces trapo_train.py (a test's own worker); `outputs` holds each
    rank's (stdout, stderr) once `wait` has returned."""

    def __init__(self, args, nproc=1, env=None, fresh=False, script="trapo_train.py"):
        env = env or runtime.subprocess_env()
        port = free_port()
        self.logs = []  # (stdout, stderr) files of each rank: pipes could fill while another rank is waited on
        self.outputs: list[tuple[str, str]] = []
        self.procs = []
        for rank in range(nproc):
            cmd = [sys.executable, "-u", script, *args]
            rank_env = env
            if nproc > 1:
                cmd.append(f"--local_rank={rank}")
                rank_env = env | {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(nproc),
                    "CROSS_RANK": "0",
                    "CROSS_SIZE": "1",
                    "LOCAL_SIZE": str(nproc),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                }
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self.logs.append((out, err))
            group = self.pgid if self.procs else 0  # rank 0 leads a new process group, the others join it
            server = None if fresh else _server(rank_env)
            if server is not None:  # the same process, without its imports
                self.procs.append(server.start(cmd[2:], rank_env, out, err, group))
            else:
                self.procs.append(
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=rank_env, stdout=out, stderr=err, text=True, process_group=group
                    )
                )

    @property
    def pgid(self) -> int:
        return self.procs[0].pid

    def wait(self, timeout=600) -> subprocess.CompletedProcess:
        """Every rank's exit, or the first failure's (the others then get SIGTERM); their output, rank by rank."""
        deadline = time.monotonic() + timeout
        code = None  # the first failure seen, as launch.py reports it (the ranks it then stops exit -15)
        while any(p.poll() is None for p in self.procs):
            failed = [p.returncode for p in self.procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if time.monotonic() > deadline:
                os.killpg(self.pgid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(self.procs[0].args, timeout)
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:  # as launch.py: 30 s to stop (a rank may sit in a collective with a dead one), then killed
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if code is None:
            code = next((p.returncode for p in self.procs if p.returncode), 0)
        for out, err in self.logs:
            out.seek(0)
            err.seek(0)
            self.outputs.append((out.read(), err.read()))
            out.close()
            err.close()
        return subprocess.CompletedProcess(
            self.procs[0].args, code, "".join(o for o, _ in self.outputs), "".join(e for _, e in self.outputs)
        )


def train(args, nproc=1, check=True, env=None, fresh=False):
    """A run to its end (`Ranks`); fresh: each rank a new interpreter, for a test of what the imports do."""
    out = Ranks(args, nproc, env, fresh).wait()
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def stopped_at(run_dir, dest, step):
    """`run_dir` copied to `dest` without its checkpoints after `step`: the run as a stop at `step` leaves it, but
    for the later rows of its logs, which resume_from=latest drops (as after a kill -9 past the checkpoint).
    A resume test resumes the copy instead of running a second run up to `step`."""
    shutil.copytree(run_dir, dest)
    for ckpt in (Path(dest) / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return Path(dest)


NOT_COMPARED = {"timing", "tokens_per_s", "rollout_generate_s"}  # wall-clock figures: what two runs never share


def rows(run_dir, leave_out=NOT_COMPARED):
    """The run's metrics.jsonl rows without the keys `leave_out`: what two runs that must agree are compared by."""
    return [{k: v for k, v in row.items() if k not in leave_out} for row in metrics(run_dir)]


def final_weights(run_dir):
    """(the last checkpoint's name, its Hugging Face weights)."""
    from safetensors.torch import load_file

    last = sorted(Path(run_dir, "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[-1]))[-1]
    weights = {}
    for f in (last / "hf").glob("*.safetensors"):
        weights.update(load_file(f))
    return last.name, weights


def same_weights(a, b):
    """Whether runs `a` and `b` ended at the same step with bit-equal weights."""
    (step_a, wa), (step_b, wb) = final_weights(a), final_weights(b)
    return step_a == step_b and wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def selections(run_dir):
    with open(os.path.join(run_dir, "selection.jsonl")) as f:
        return [json.loads(line) for line in f]


def wait_rows(proc, run_dir, rows: int, timeout: float = 300, poll: float = 0.1) -> bool:
    """Wait until the run in `run_dir` has logged `rows` steps while `proc` (its training rank) runs: whether
    it has, with `proc` still running (to stop it after a given step)."""
    log = Path(run_dir) / "metrics.jsonl"
    count = lambda: len(log.read_text().splitlines()) if log.is_file() else 0  # noqa: E731
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and count() < rows:
        time.sleep(poll)
    return proc.poll() is None and count() >= rows


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
