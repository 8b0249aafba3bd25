"""A sweep's runs forked from one pre-imported parent, on CPU.

A toy run's steps take a fraction of a second, and a run's imports (torch, transformers, DeepSpeed, vLLM) cost
more than many of its steps: a sweep of a hundred toy runs would be mostly imports. So the runner starts one
parent process that makes those imports and then only forks. Each run is a fork of it, set up as `python ARGS`
would be (its environment, working directory, argv, output files and process group) and run with runpy; the
runner sees it as it would see a `subprocess.Popen`.

The parent never runs a torch op (a fork after torch has started its thread pools can hang the child), and it is
not used on a GPU (a fork after CUDA's start-up is unsafe, and an import may start it) or with TRAPO_FORK_RUNS=0.
Every request carries its own reply socket: the parent answers on it with the child's pidfd (a signal sent
through it reaches that child, never a process that reused its pid), then with the child's exit code.

The parent's program is `serve(FD)` on its end of a socket pair (`_ENTRY`).
"""

from __future__ import annotations

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
import traceback

from trapo import runtime

# `-c`, not `-m`: the package imports this module, and `python -m` of an imported module warns
_ENTRY = ["-u", "-c", f"import sys\nfrom {__name__} import serve\nserve(int(sys.argv[1]))"]


class Parent:
    """The caller's side of one pre-imported parent, started now in `env`; safe to share between threads.
    `entry`: the parent's program (what follows `python`), which ends by calling `serve(FD)`."""

    def __init__(self, env: dict[str, str], cwd, entry: list[str] = _ENTRY):
        self.env, self.cwd = dict(env), str(cwd)
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, *entry, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.lock = threading.Lock()  # one request on the control socket at a time
        self._imported_env: dict[str, str] | None = None

    def imported_env(self) -> dict[str, str] | None:
        """The parent's environment once its imports are done (waiting for them); None if it died in them."""
        with self.lock:
            if self._imported_env is None:
                greeting = self.control.recv(1 << 20)
                if not greeting:
                    return None
                self._imported_env = json.loads(greeting)
        return self._imported_env

    def alive(self) -> bool:
        return self.proc.poll() is None

    def takes(self, env: dict[str, str], ignored: frozenset[str] = frozenset()) -> bool:
        """Whether a child in `env` can be forked here (waiting for the imports): `env` is the parent's but for
        `ignored` and the variables its imports set (a caller that made them has them too, a fresh child's
        imports would set them again)."""
        imported = self.imported_env()
        if imported is None or not self.alive():
            return False
        ignored = ignored | (imported.keys() - self.env.keys())
        return _without(env, ignored) == _without(self.env, ignored)

    def start(self, argv: list[str], env: dict[str, str], out, err, process_group: int = 0, cwd=None) -> Child:
        """`python ARGV` forked in `env` and `cwd` (default: the parent's), writing to the files `out` and `err`;
        process_group: 0 for a new group led by the child, else the group it joins. RuntimeError when the parent
        has exited (its traceback went to the caller's stderr)."""
        if self.imported_env() is None:
            raise RuntimeError("the pre-imported parent exited in its imports")
        request = {"argv": argv, "env": env, "cwd": str(cwd or self.cwd), "pgid": process_group}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self.lock:
                socket.send_fds(
                    self.control, [json.dumps(request).encode()], [out.fileno(), err.fileno(), theirs.fileno()]
                )
        except OSError as gone:
            mine.close()
            raise RuntimeError("the pre-imported parent exited") from gone
        finally:
            theirs.close()
        data, fds, _, _ = socket.recv_fds(mine, 1024, 1)
        if not data:
            mine.close()
            raise RuntimeError("the pre-imported parent exited")
        return Child(mine, json.loads(data)["pid"], fds[0], [sys.executable, "-u", *argv])

    def run(self, argv, env, cwd=None, process_group=0, timeout=None, merged=False) -> subprocess.CompletedProcess:
        """`start`, then wait for the child's end: output captured as text, as subprocess.run's (with `merged`,
        stderr into stdout). Past `timeout` seconds it is killed, with its group when it leads one, and
        subprocess.TimeoutExpired raised holding what it wrote."""
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            child = self.start(argv, env, out, out if merged else err, process_group, cwd)
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill_group() if process_group == 0 else child.kill()
                child.wait()
                raise subprocess.TimeoutExpired(child.args, timeout, *_read(out, err)) from None
            return subprocess.CompletedProcess(child.args, child.returncode, *_read(out, err))

    def close(self) -> None:
        """The parent exits on EOF; children still running carry on, as a Popen's children would."""
        self.control.close()
        self.proc.wait()


class Child:
    """A forked child, with the subprocess.Popen methods its callers use."""

    def __init__(self, reply: socket.socket, pid: int, pidfd: int, args: list[str]):
        self.reply, self.pid, self.pidfd, self.args = reply, pid, pidfd, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None and _readable(self.reply, 0) else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self.reply, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            data = self.reply.recv(1024)
            # the parent died before it could tell (killed with the caller's group): the child went with it, or
            # is an orphan nobody waits for; either way its code is lost
            self.returncode = json.loads(data)["code"] if data else -signal.SIGKILL
            self.reply.close()
            os.close(self.pidfd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen's: an ended child is not signalled
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:  # it ended since: its code is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL to the process group it leads, with what it started."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_python(args: list[str], cwd) -> subprocess.CompletedProcess:
    """`python ARGS` (a script or `-m module`, then its arguments) to its end in `cwd`, with the environment of a
    child process (`runtime.subprocess_env()`), output captured as text: forked from this process's parent
    (started at the first run) on CPU where it takes that environment, else a fresh interpreter (on a GPU, with
    TRAPO_FORK_RUNS=0). A run stays in the caller's process group, as a subprocess's: Ctrl-C reaches it too."""
    env = runtime.subprocess_env()
    parent = None if os.environ.get("TRAPO_FORK_RUNS", "1") == "0" or runtime.has_gpu() else _sweep_parent(env)
    if parent is None or not parent.takes(env):
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=cwd)
    return parent.run(args, env, cwd=cwd, process_group=os.getpgrp())


class RunFailed(RuntimeError):
    """A run of a sweep or study that ended badly, said in one line (its whole output kept in a file)."""


def require_success(proc: subprocess.CompletedProcess, what: str, where) -> None:
    """RunFailed naming `what` and how it ended unless `proc` exited 0; its stderr kept in `where`/stderr.txt.
    A run killed by SIGKILL that it did not ask for is most often the kernel's out-of-memory killer."""
    if proc.returncode == 0:
        return
    os.makedirs(where, exist_ok=True)
    kept = os.path.join(where, "stderr.txt")
    with open(kept, "w") as f:
        f.write(proc.stderr or "")
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        how = f"was killed by {name}"
        if -proc.returncode == signal.SIGKILL:
            how += " (most often the kernel's out-of-memory killer: `dmesg | tail` says; run fewer jobs at once)"
    else:
        lines = [line for line in (proc.stderr or "").splitlines() if line.strip()]
        how = f"failed (exit {proc.returncode})" + (f": {lines[-1].strip()}" if lines else "")
    raise RunFailed(f"{what} {how}; its output: {kept}; the same command again keeps the finished runs")


_PARENTS: list[Parent] = []
_STARTING = threading.Lock()


def _sweep_parent(env: dict[str, str]) -> Parent:
    with _STARTING:  # a sweep's parallel jobs ask at once: one parent
        if not _PARENTS or not _PARENTS[0].alive():
            _PARENTS[:] = [Parent(env, runtime.ROOT)]
            atexit.register(close_parent)
    return _PARENTS[0]


def close_parent() -> None:
    """This process's parent, if it started one, told to exit (children still running carry on)."""
    with _STARTING:
        for parent in _PARENTS:
            parent.close()
        _PARENTS.clear()


def _without(env: dict[str, str], ignored: frozenset[str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in ignored}


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


def _read(*files) -> list[str]:
    for f in files:
        f.seek(0)
    return [f.read() for f in files]


# ---------------------------------------------------------------- the parent's process


def preload() -> None:
    """What a trainer, `trapo eval` and their vLLM engine import, imported once for every child."""
    runtime.configure()
    from trapo.engine.dist import import_deepspeed

    import_deepspeed()  # as the trainer does: without MLflow's import, which a child makes if it logs there
    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    try:
        # vllm.LLM is a lazy attribute and the engine picks its CPU worker by name: each child that starts an
        # engine would import them again
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401
        from vllm.v1.worker import cpu_worker  # noqa: F401
    except ImportError:  # the hf backend only
        pass

    import trapo.commands.eval  # noqa: F401
    import trapo.commands.train  # noqa: F401
    import trapo.training.trainer  # noqa: F401


def serve(fd: int) -> None:
    """The parent's loop on its end `fd` of the control socket: the imports, a greeting with its environment, then
    each request forked, its pidfd and later its exit code sent on the request's reply socket. Ends when the
    caller closes the control socket."""
    try:
        _serve(fd)
    except (BrokenPipeError, ConnectionResetError):  # the caller is gone
        pass


def _serve(fd: int) -> None:
    preload()
    gc.collect()
    gc.freeze()  # the children's collections skip what the imports made
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller and the children
    control = socket.socket(fileno=fd)
    control.send(json.dumps(dict(os.environ)).encode())
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, reply socket)
    while True:
        for ready in select.select([control, *children], [], [])[0]:
            if ready is not control:  # a pidfd turns readable when its child exits
                pid, reply = children.pop(ready)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                _tell(reply, {"code": code})
                reply.close()
                os.close(ready)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
            except OSError:
                data = b""
            if not data:
                return
            request, (out, err, reply_fd) = json.loads(data), fds
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                held = [control.fileno(), reply_fd, *children, *(r.fileno() for _, r in children.values())]
                _become(request, out, err, held)
            try:  # here too, as a shell does: the group exists before the next child asks to join it
                os.setpgid(pid, request["pgid"] or pid)
            except OSError:  # the child got there first
                pass
            os.close(out)
            os.close(err)
            reply = socket.socket(fileno=reply_fd)
            pidfd = os.pidfd_open(pid)
            try:
                socket.send_fds(reply, [json.dumps({"pid": pid}).encode()], [pidfd])
            except OSError:  # the caller is gone; the child is still reaped
                pass
            children[pidfd] = (pid, reply)


def _tell(reply: socket.socket, message: dict) -> None:
    try:
        reply.send(json.dumps(message).encode())
    except OSError:  # that caller is gone
        pass


def _become(request: dict, out: int, err: int, held: list[int]) -> None:
    """In the forked child: become `python ARGV`, then exit with its code (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        for fd in held:
            os.close(fd)
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
        else:
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
