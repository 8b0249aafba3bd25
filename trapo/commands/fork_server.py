"""A pre-imported parent that forks Python children: the runs of a sweep, and the tests' trainer processes.

A trainer process spends about 6 s of CPU importing torch, transformers and DeepSpeed (and vLLM, 14 s in all)
before its first step, where a toy run's step takes a fraction of a second: a sweep of toy runs on CPU (`trapo
reproduce`, with or without `--study`), and the test suite, were mostly imports. The fork server is a Python
process that has imported what a trainer imports and then only forks. A child is a fork of it, set up as `python
-u ARGS` would be: its own process and process group (or one it joins), the caller's files on its stdout and
stderr, its environment, its working directory and argv, the script or module run as __main__. Its exit code
comes back as a subprocess.Popen's would (minus the signal for a killed one). The child's code is the same; only
the imports were done before the fork, in the server's environment: a child whose environment differs in more
than the `per_run` variables and what the imports set (`ForkServer.accepts`) forks from a server started in its
own, or starts as a plain process (`ForkServers`). A sweep's runs also fork their Math-Verify supervisors from one
warm parent (`trapo.algorithm.rewards.verify_zygote`).

The server never runs a torch op (a fork after torch has started its thread pools can hang in the child),
and it is not used on a GPU machine: a fork after CUDA's start-up is unsafe, and an import may start it.
TRAPO_FORK_RUNS=0 starts every child of a sweep afresh.

    python -u -m trapo.commands.fork_server FD     # the server itself, on its end of a socket pair
"""

import atexit
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from trapo import runtime
from trapo.algorithm.rewards import verify_zygote

# What may differ between the server's environment and a child's: the launcher's variables for each rank,
# read by the trainer at run time, never at import.
LAUNCHER_VARS = frozenset(
    ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "RANK", "LOCAL_RANK")
)

# A random id MLflow's import puts in os.environ (its telemetry session): the caller has it once it imported MLflow,
# the server (which imports DeepSpeed without it, `dist.import_deepspeed`) does not; nothing reads it at import.
SESSION_IDS = frozenset(("_MLFLOW_TELEMETRY_SESSION_ID",))


class ForkServer:
    """The caller's side: one server process, the children forked from it, their exit codes as they come.
    Safe to share between threads (a sweep's parallel jobs)."""

    def __init__(self, env: dict[str, str], cwd: str | os.PathLike, per_run: frozenset[str] = LAUNCHER_VARS):
        self.env, self.cwd, self.per_run = env, str(cwd), per_run
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "trapo.commands.fork_server", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.codes: dict[int, int] = {}  # exit codes of children no one has asked for yet
        self.unclaimed: set[int] = set()  # children whose exit code no one has taken yet: running, or just ended
        self.promised = 0  # children a pool handed this server out for (`ForkServers.server`), not started yet
        self.ready = False  # the server has done its imports
        self.imported_env: dict[str, str] = {}  # the server's environment after them
        self.started: int | None = None  # the pid of the child the last request forked
        self.lock = threading.Lock()  # one request, or one read of the socket, at a time

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a child in `env` can be forked from here (waiting for the server's imports): `env` is the
        server's environment but for `per_run` keys, `SESSION_IDS` and the variables its imports set (vLLM's
        sets PYTORCH_NVML_BASED_CUDA_CHECK and TORCHINDUCTOR_CACHE_DIR): a caller that made the same imports has
        them too, and a fresh child's imports would set them again."""
        try:
            with self.lock:
                while not self.ready:
                    self._receive(block=True)
        except RuntimeError:  # it exited in its imports (their traceback went to the caller's stderr)
            return False
        if self.proc.poll() is not None:
            return False
        ignored = self.per_run | SESSION_IDS | (self.imported_env.keys() - self.env.keys())
        strip = lambda e: {k: v for k, v in e.items() if k not in ignored}  # noqa: E731
        return strip(env) == strip(self.env)

    def _receive(self, block: bool) -> None:
        while select.select([self.sock], [], [], None if block else 0)[0]:
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("the fork server exited (its stderr is the caller's)")
            message = json.loads(data)
            if "exit" in message:
                self.codes[message["exit"]] = message["code"]
            elif "ready" in message:
                self.ready, self.imported_env = True, message["env"]
            else:
                self.started = message["pid"]
            block = False

    def start(self, argv: list[str], env: dict[str, str], out, err, process_group: int, cwd=None) -> "Forked":
        """Fork a child running `argv` (what follows `python`: a script or `-m module`, then the arguments) with
        `env` in `cwd` (default: the server's), writing to the files `out` and `err`; process_group: 0 for a new
        group led by the child, else the group to join."""
        request = {"argv": argv, "env": env, "cwd": str(cwd or self.cwd), "pgid": process_group}
        with self.lock:
            while not self.ready:
                self._receive(block=True)
            self.started = None
            socket.send_fds(self.sock, [json.dumps(request).encode()], [out.fileno(), err.fileno()])
            while self.started is None:
                self._receive(block=True)
            self.unclaimed.add(self.started)
            self.promised = max(0, self.promised - 1)
            return Forked(self, self.started, [sys.executable, "-u", *argv])

    def run(self, argv: list[str], env: dict[str, str], process_group: int = 0, cwd=None, timeout=None):
        """`start`, then wait for the child's end (`timeout` seconds at most: then it is killed, with its group
        when it leads one, and subprocess.TimeoutExpired raised): a subprocess.CompletedProcess with the output
        as text."""
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            child = self.start(argv, env, out, err, process_group, cwd)
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                if process_group == 0:  # it leads its own group: what it started goes too
                    try:
                        os.killpg(child.pid, signal.SIGKILL)
                    except ProcessLookupError:  # the group ended at the timeout: as Forked.send_signal
                        pass
                else:
                    child.kill()
                child.wait()
                raise
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(child.args, child.returncode, out.read(), err.read())

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            self._receive(block=False)
            code = self.codes.pop(pid, None)
            if code is not None:
                self.unclaimed.discard(pid)
            return code

    def promise(self) -> None:
        """One more child is coming (`start`): the server is not idle until it has started."""
        with self.lock:
            self.promised += 1

    def idle(self) -> bool:
        """No child is promised to it, and no child's exit code is still to come from it or to be taken: closing it
        loses nothing."""
        with self.lock:
            return not self.unclaimed and not self.promised

    def close(self) -> None:
        self.sock.close()  # the server exits on EOF; children still going carry on, as a Popen's children would
        self.proc.wait()


class ForkServers:
    """Fork servers by environment, each started when a child first needs it. A child forks from a server whose
    environment is the child's but for the `per_run` keys: the server's imports ran in that environment. The
    caller's environment can change while it runs (a library it imports sets a variable, as tensorboardX sets
    CRC32C_SW_MODE; a test points HF_HUB_CACHE elsewhere), and one server would then see its later children all
    start afresh. An environment gets its own server once `fresh_first` children of it have started afresh (a
    server costs about what one child's imports cost: an environment used once is cheaper fresh). At most `limit`
    servers run (each holds ~0.5 GB): a new one replaces the least recently used idle one, or if none is idle
    the child starts afresh. Safe to share between threads."""

    def __init__(self, cwd, per_run: frozenset[str] = LAUNCHER_VARS, fresh_first: int = 0, limit: int = 3):
        self.cwd, self.per_run, self.fresh_first, self.limit = cwd, per_run, fresh_first, limit
        self.servers: list[ForkServer] = []  # the least recently used first
        self.fresh: dict[frozenset, int] = {}  # children started afresh so far, by environment
        self.lock = threading.Lock()
        atexit.register(self.close)

    def server(self, env: dict[str, str]) -> ForkServer | None:
        """The server to fork a child in `env` from, started now if its turn has come; None: start it afresh."""
        shared = {k: v for k, v in env.items() if k not in self.per_run}  # what the server's imports run in
        key = frozenset(shared.items())
        with self.lock:
            server = next((s for s in self.servers if s.accepts(env)), None)  # a dead server accepts none
            if server is None and self.fresh.get(key, 0) >= self.fresh_first and self._make_room():
                server = ForkServer(shared, self.cwd, self.per_run)
            if server is None:
                self.fresh[key] = self.fresh.get(key, 0) + 1
                return None
            if server in self.servers:
                self.servers.remove(server)
            self.servers.append(server)  # now the most recently used
            server.promise()  # not idle until the caller's child has started: no other thread's call closes it
            return server

    def _make_room(self) -> bool:
        """Whether a server can start: fewer than `limit` run, or the least recently used idle one closed."""
        if len(self.servers) < self.limit:
            return True
        idle = next((s for s in self.servers if s.idle()), None)
        if idle is None:
            return False
        self.servers.remove(idle)
        idle.close()
        return True

    def close(self) -> None:
        with self.lock:
            for server in self.servers:
                server.close()
            self.servers.clear()


def run_python(args: list[str], cwd: str | os.PathLike) -> subprocess.CompletedProcess:
    """`python ARGS` (a script or `-m module`, then its arguments) to its end in `cwd`, with the environment of
    a child process (`runtime.subprocess_env()`), output captured as text: forked from this process's fork
    server (started at the first child, after what the sweep built first: a sweep runs many) on CPU, a fresh
    interpreter on GPU or with TRAPO_FORK_RUNS=0."""
    env = runtime.subprocess_env()
    server = None
    if _forking():  # the runs' Math-Verify supervisors fork from one zygote too: the caller's, or this sweep's
        if verify_zygote.ENV not in env:
            env[verify_zygote.ENV] = _sweep_verify_zygote().name
        server = _sweep_servers().server(env)
    if server is None:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=cwd)
    # in the caller's process group, as a subprocess's: Ctrl-C in the terminal reaches the child too
    return server.run(args, env, process_group=os.getpgrp(), cwd=cwd)


def _forking() -> bool:
    return os.environ.get("TRAPO_FORK_RUNS", "1") != "0" and not runtime.has_gpu()


_SWEEP_SERVERS: list[ForkServers] = []  # this process's, made at its first forked child
_SWEEP_VERIFY_ZYGOTES: list[verify_zygote.Zygote] = []  # the same
_STARTING = threading.Lock()


def _sweep_servers() -> ForkServers:
    with _STARTING:
        if not _SWEEP_SERVERS:
            _SWEEP_SERVERS.append(ForkServers(runtime.ROOT))
    return _SWEEP_SERVERS[0]


def _sweep_verify_zygote() -> verify_zygote.Zygote:
    with _STARTING:
        if not _SWEEP_VERIFY_ZYGOTES:
            _SWEEP_VERIFY_ZYGOTES.append(verify_zygote.Zygote(runtime.subprocess_env()))
    return _SWEEP_VERIFY_ZYGOTES[0]


class Forked:
    """A forked child, with the subprocess.Popen methods its callers use (poll, wait, signals)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended after the poll: its exit code is on its way (as Popen's)
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ----------------------------------------------------------------------------- the server's side


def _run_child(sock: socket.socket, request: dict, out: int, err: int) -> None:
    """In the forked child: become `python ARGS`, then exit with its code (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter (the server ignores it)
        sock.close()
        os.setpgid(0, request["pgid"])
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        argv = request["argv"]
        if argv[0] == "-m":  # python -m module ARGS: runpy puts the module's file in argv[0]
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python script.py ARGS
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:  # what the interpreter makes of sys.exit(x)
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a script: the traceback, code 1
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()  # the child's own exit handlers, as at a script's end
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def _serve(fd: int) -> None:
    runtime.configure()
    from trapo.engine.dist import import_deepspeed

    import_deepspeed()  # as the trainer does: without MLflow's import (1.5 s), which a child makes if it logs there
    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    try:
        import vllm  # noqa: F401
    except ImportError:  # the hf backend only (as on a GPU machine without vLLM)
        pass

    import trapo.commands.eval  # noqa: F401
    import trapo.commands.train  # noqa: F401
    import trapo.training.trainer  # noqa: F401

    gc.collect()
    gc.freeze()  # the children's collections skip what the imports made: ~0.3 s of CPU each in a toy run

    # Ctrl-C in the caller's terminal is for the caller and the children: the server ends when the caller
    # closes its socket, children still running or not
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    sock.send(json.dumps({"ready": True, "env": dict(os.environ)}).encode())
    running: set[int] = set()
    while True:
        if select.select([sock], [], [], 0.02)[0]:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 65536, 2)
            except OSError:
                data = b""
            if not data:
                return  # the caller closed: children still going are left to finish
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(sock, request, *fds)
            try:  # here too, as a shell does: the group exists before the next rank asks to join it
                os.setpgid(pid, request["pgid"] or pid)
            except OSError:  # the child got there first
                pass
            for f in fds:
                os.close(f)
            running.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    try:
        _serve(int(sys.argv[1]))
    except (BrokenPipeError, ConnectionResetError):  # the caller is gone: nothing left to tell it
        pass
