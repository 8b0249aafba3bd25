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
own, or starts as a plain process (`ForkServers`).

The server never runs a torch op (a fork after torch has started its thread pools can hang in the child),
and it is not used on a GPU machine: a fork after CUDA's start-up is unsafe, and an import may start it.
TRAPO_FORK_RUNS=0 starts every child of a sweep afresh.

Its process is trapo/commands/fork_server/serve.py. On CPU, a launcher's rank whose caller runs a fork server
(NAME_ENV in its environment) hands its run to a child forked there and stands in for it (`forward`).
"""

import atexit
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

from trapo import runtime

# What may differ between the server's environment and a child's: the launcher's variables for each rank,
# read by the trainer at run time, never at import (its CUDA_VISIBLE_DEVICES, by CUDA's start-up: never where a
# fork server runs, on CPU).
LAUNCHER_VARS = frozenset(
    (
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
        "LOCAL_SIZE",
        "RANK",
        "LOCAL_RANK",
        "CUDA_VISIBLE_DEVICES",
    )
)

# Variables that imports the server does not make put in os.environ, read by nothing the server imported: the
# caller has them once it made those imports, a child that makes them sets them again. MLflow's telemetry session
# id (the server imports DeepSpeed without MLflow, `dist.import_deepspeed`); tensorboardX's crc32c mode.
IMPORT_SET = frozenset(("_MLFLOW_TELEMETRY_SESSION_ID", "CRC32C_SW_MODE"))

# Read by the interpreter at its start only: a forked child's was the server's, started as `python -u`.
STARTUP_VARS = frozenset(("PYTHONUNBUFFERED",))

# The name a child finds its server by: a sweep forked from a server (a test's `trapo reproduce`, the GPU check's
# dry run) forks its own children there too, instead of starting a server of its own (`run_python`).
NAME_ENV = "TRAPO_FORK_SERVER"


class ForkServer:
    """The caller's side: one server process, the children forked from it, their exit codes as they come.
    Safe to share between threads (a sweep's parallel jobs)."""

    def __init__(self, env: dict[str, str], cwd: str | os.PathLike, per_run: frozenset[str] = LAUNCHER_VARS, sock=None):
        """A server started now in `env`, this caller its owner; given `sock`, a socket connected to a running
        server (`connect`), one more caller of it (its greeting then gives `env` and `per_run`)."""
        self.env, self.cwd, self.per_run = env, str(cwd), per_run
        self.proc = None  # the server's process, where this caller started it
        if sock is None:
            sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            argv = ["-u", "-m", "trapo.commands.fork_server.serve", str(theirs.fileno()), *sorted(per_run)]
            self.proc = subprocess.Popen(
                [sys.executable, *argv],
                pass_fds=[theirs.fileno()],
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
            theirs.close()
        self.sock = sock
        self.codes: dict[int, int] = {}  # exit codes of children no one has asked for yet
        self.unclaimed: set[int] = set()  # children whose exit code no one has taken yet: running, or just ended
        self.promised = 0  # children a pool handed this server out for (`ForkServers.server`), not started yet
        self.ready = False  # the server has done its imports
        self.imported_env: dict[str, str] = {}  # the server's environment after them
        self.started: int | None = None  # the pid of the child the last request forked
        self.name = ""  # the server's name (NAME_ENV), known once it is ready
        self.sid = os.getsid(0)  # the server's session: a child can join only a process group in it
        self.lock = threading.Lock()  # one request, or one read of the socket, at a time

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a child in `env` can be forked from here (waiting for the server's imports): `env` is the
        server's environment but for `per_run` keys, `IMPORT_SET`, `STARTUP_VARS`, NAME_ENV and the variables its
        imports set (vLLM's sets PYTORCH_NVML_BASED_CUDA_CHECK and TORCHINDUCTOR_CACHE_DIR): a caller that made
        the same imports has them too, and a fresh child's imports would set them again. PYTHONPATH is compared
        without repeated entries (`_imports_see`)."""
        try:
            with self.lock:
                while not self.ready:
                    self._receive(block=True)
        except RuntimeError:  # it exited in its imports (their traceback went to the caller's stderr)
            return False
        if self.proc is not None and self.proc.poll() is not None:
            return False
        ignored = self.per_run | IMPORT_SET | STARTUP_VARS | {NAME_ENV} | (self.imported_env.keys() - self.env.keys())
        return _imports_see(env, ignored) == _imports_see(self.env, ignored)

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
                self.env, self.sid, self.per_run = message["base"], message["sid"], frozenset(message["per_run"])
                self.name = message["name"]
            else:
                self.started = message["pid"]
            block = False

    def start(self, argv: list[str], env: dict[str, str], out, err, process_group: int, cwd=None, lifeline=None):
        """Fork a child running `argv` (what follows `python`: a script or `-m module`, then the arguments) with
        `env` in `cwd` (default: the server's), writing to the files `out` and `err`; process_group: 0 for a new
        group led by the child, else the group to join. `lifeline`: the read end of a pipe whose write end only
        the caller holds: the child dies when it closes (`forward`)."""
        request = {"argv": argv, "env": env, "cwd": str(cwd or self.cwd), "pgid": process_group}
        fds = [out.fileno(), err.fileno(), *([] if lifeline is None else [lifeline])]
        with self.lock:
            while not self.ready:
                self._receive(block=True)
            self.started = None
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            while self.started is None:
                self._receive(block=True)
            self.unclaimed.add(self.started)
            self.promised = max(0, self.promised - 1)
            return Forked(self, self.started, [sys.executable, "-u", *argv])

    def run(self, argv, env: dict[str, str], process_group: int = 0, cwd=None, timeout=None, merged: bool = False):
        """`start`, then wait for the child's end: a subprocess.CompletedProcess with the output as text (with
        `merged`, stderr in stdout, as subprocess's stderr=STDOUT). Past `timeout` seconds it is killed, with its
        group when it leads one, and subprocess.TimeoutExpired raised holding what it wrote, as subprocess.run's."""
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            child = self.start(argv, env, out, out if merged else err, process_group, cwd)
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
                raise subprocess.TimeoutExpired(child.args, timeout, *_read(out, err)) from None
            return subprocess.CompletedProcess(child.args, child.returncode, *_read(out, err))

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

    @classmethod
    def connect(cls, name: str) -> "ForkServer | None":
        """Another caller of the running server `name` (NAME_ENV in a child's environment), or None when it is
        gone. Its children can join process groups of the server's session only (`sid`)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect("\0" + name)
        except OSError:
            sock.close()
            return None
        self = cls({}, os.getcwd(), frozenset(), sock)
        try:
            self._receive(block=True)  # its greeting: the environment it was started in, `per_run`, its session
        except (RuntimeError, OSError):
            sock.close()
            return None
        return self

    def close(self) -> None:
        self.sock.close()  # the server exits on EOF; children still going carry on, as a Popen's children would
        if self.proc is not None:  # a connected caller leaves the server to its owner
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
        shared = self._shared(env)
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

    def prestart(self, env: dict[str, str]) -> None:
        """A server for `env` started now, where none runs yet: the caller knows many children in `env` will come,
        and has other work to do while the server imports (it does not wait for them here)."""
        with self.lock:
            if not self.servers and self._make_room():
                self.servers.append(ForkServer(self._shared(env), self.cwd, self.per_run))

    def _shared(self, env: dict[str, str]) -> dict[str, str]:
        """What a server's imports run in, for children in `env`: all of it but the `per_run` keys."""
        return {k: v for k, v in env.items() if k not in self.per_run}

    def running(self, env: dict[str, str]) -> ForkServer | None:
        """The running server a child in `env` would fork from, if any (none is started, none is promised)."""
        with self.lock:
            return next((s for s in self.servers if s.accepts(env)), None)

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
    server = server_for(env)
    if server is None:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=cwd)
    # in the caller's process group, as a subprocess's: Ctrl-C in the terminal reaches the child too
    return server.run(args, env, process_group=os.getpgrp(), cwd=cwd)


def server_for(env: dict[str, str]) -> ForkServer | None:
    """The server to fork a child in `env` from (`ForkServer.start`), or None: start it afresh (on a GPU, with
    TRAPO_FORK_RUNS=0, or while its environment's turn for a server has not come). The server this process was
    forked from where it takes `env`, else one of this process's own (`ForkServers`)."""
    if not _forking():
        return None
    name = os.environ.get(NAME_ENV)
    parent = _first(_PARENT_SERVER, lambda: ForkServer.connect(name) if name else None)
    # its children join this process's group (`run_python`): in its session only
    if parent is not None and parent.sid == os.getsid(0) and parent.accepts(env):
        return parent
    return _sweep_servers().server(env)


# The signals a standing-in caller passes on to its child (`forward`): what a launcher or a shell sends a rank.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def forward(argv: list[str]) -> int | None:
    """`python ARGV` (this process's own command line) run by a child forked from the fork server named in the
    environment (NAME_ENV), this process standing in for it: the child writes where this process writes, gets
    the signals this process gets (`FORWARDED`), dies with it (a kill -9 included), and its exit is this
    process's exit code, or its death by a signal this process's. For a launcher's ranks on CPU under a caller
    that runs a fork server (the tests' launcher runs, the GPU check's dry run): ~6-10 s of imports saved each.
    None: run here (no such server, one that does not take this environment, a GPU, or this process has made
    a trainer's imports already, as a forked child has)."""
    name = os.environ.get(NAME_ENV)
    if not name or "torch" in sys.modules or not _forking():
        return None
    server = ForkServer.connect(name)
    env = dict(os.environ)
    if server is None or not server.accepts(env):
        return None
    lifeline, held = os.pipe()  # `held` is open in this process only (not inherited): its end is the child's end
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # a signal before the handlers are in waits for them
    try:
        child = server.start(argv, env, sys.stdout, sys.stderr, 0, os.getcwd(), lifeline)
        for number in FORWARDED:  # straight to the child: a handler may run while `wait` holds the server's lock
            signal.signal(number, lambda received, _: _pass_on(child.pid, received))
    except (RuntimeError, OSError):  # the server ended since it answered: the run is here after all
        return None
    finally:
        os.close(lifeline)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    code = child.wait()
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _read(*files) -> list[str]:
    """What each of `files` (a child's output, written at the file level) holds, from its start."""
    for f in files:
        f.seek(0)
    return [f.read() for f in files]


def _pass_on(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:  # it has ended: its exit code is on its way
        pass


def _imports_see(env: dict[str, str], ignored: set[str]) -> dict[str, str]:
    """What of `env` the server's imports may have read: all but `ignored`, PYTHONPATH without repeated entries
    (the deepspeed launcher puts its working directory first again)."""
    seen = {k: v for k, v in env.items() if k not in ignored}
    if "PYTHONPATH" in seen:
        seen["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(seen["PYTHONPATH"].split(os.pathsep)))
    return seen


def _forking() -> bool:
    return os.environ.get("TRAPO_FORK_RUNS", "1") != "0" and not runtime.has_gpu()


_SWEEP_SERVERS: list[ForkServers] = []  # this process's, made at its first forked child
_PARENT_SERVER: list[ForkServer | None] = []  # the server that forked this process, reached at its first child
_STARTING = threading.Lock()


def _first(made: list, make):
    """made[0], made by `make()` at this process's first call (a thread that races it waits for it)."""
    with _STARTING:
        if not made:
            made.append(make())
    return made[0]


def _sweep_servers() -> ForkServers:
    return _first(_SWEEP_SERVERS, lambda: ForkServers(runtime.ROOT))


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
        if self.poll() is None:  # as Popen's: an ended child is not signalled
            _pass_on(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
