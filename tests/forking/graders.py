"""The grader parent: a warm parent for the tests' Math-Verify supervisors. It imports and warms up Math-Verify
once, then forks a supervisor for each verifier that asks.

A supervisor (trapo/engine/grading/supervisor.py) spends about 1 s of CPU on sympy's and Math-Verify's imports
and its warm-up before it grades anything: as much as a short toy run's own work. The test suite starts one
`GraderParent` per worker and names it in the environment as ENV; `install()`, called in a process whose
environment names one (the pytest process, a trainer forked for a test), replaces the package's one seam for
starting a supervisor (`trapo.engine.grading.verifier.start_supervisor`): a `MathVerifier` there then asks the
parent for its supervisor (`fork_supervisor`), handing over the pipes and the environment it would have given a
started one. The parent runs with the supervisor's fixed hash seed, so a forked supervisor's verdicts are a
started one's. Only the default verifier (`math`) of the parent's own package and interpreter is forked: a task
verifier imports the user's module, from the trainer's directory and path, and an installed wheel's verifier
runs the wheel's code. Where ENV is unset, or the parent does not answer, the supervisor starts as in a user's
run.

The parent's socket (abstract, unix) listens from the moment `GraderParent()` returns: a verifier that asks
before the parent's imports are done waits for them instead of starting a supervisor of its own. The parent ends
when its owner closes the lifeline (its stdin) or dies. A forked supervisor is the parent's child, not the
trainer's; it ends as a started one does, when the trainer closes its stdin or kills it (`Forked`, through a
pidfd the parent sends).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import trapo
from trapo.engine.grading import verifier
from trapo.engine.grading.verifier import supervisor_env

ENV = "TRAPO_TESTS_GRADER_PARENT"
_PACKAGE_PARENT = Path(trapo.__file__).resolve().parents[1]  # the directory that holds this process's `trapo/`
_REPLY_TIMEOUT = 120.0  # the parent's imports and warm-up, on a machine busy with other start-ups
_REQUEST_BYTES = 1 << 20  # a request carries the asker's environment
start_fresh = verifier.start_supervisor  # the package's own: a supervisor started as in a user's run


class GraderParent:
    """The owner's side: `name` goes into the trainers' environment (ENV); `close()` (or the owner's exit) ends it."""

    def __init__(self, env: dict[str, str] | None = None):
        self.name = f"trapo-tests-graders-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        env = supervisor_env(os.environ if env is None else env)
        env.pop(ENV, None)
        # Listening from here on: who asks before the parent's imports are done waits for them.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind("\0" + self.name)
            listener.listen(64)
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(listener.fileno())],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=[listener.fileno()],
                start_new_session=True,  # a Ctrl-C at the terminal is for the owner; the parent ends with it
            )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Forked:
    """A supervisor forked by the grader parent, as `subprocess.Popen` shows a started one to `MathVerifier`:
    `pid`, `stdin`, `stdout`, `poll()`, `kill()`, `wait()`. Its exit status goes to its parent, the grader parent:
    `poll()` returns None while it runs and then `returncode`, -1 (not its status)."""

    returncode = -1

    def __init__(self, pid: int, pidfd: int, stdin_fd: int, stdout_fd: int):
        self.pid, self._pidfd = pid, pidfd
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)

    def poll(self) -> int | None:
        return self.wait(timeout=0)

    def wait(self, timeout: float | None = None) -> int | None:
        """`returncode` once it has ended (a pidfd is readable then); None if `timeout` (seconds) comes first."""
        if self._pidfd is not None and not select.select([self._pidfd], [], [], timeout)[0]:
            return None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def kill(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass


def fork_supervisor(workers: int, max_workers: int, spec: str) -> Forked | None:
    """A supervisor from the grader parent that ENV names; None when there is none, `spec` is a task verifier, or
    the parent does not answer (the caller then starts one itself)."""
    name = os.environ.get(ENV)
    if not name or spec != "math":
        return None
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(_REPLY_TIMEOUT)
            sock.connect("\0" + name)
            # what a started one would be: its environment, this package and interpreter (a wheel's, say)
            request = {"workers": workers, "max_workers": max_workers, "env": supervisor_env(os.environ)}
            request |= {"package": str(_PACKAGE_PARENT), "python": sys.executable}
            socket.send_fds(sock, [json.dumps(request).encode()], [stdin_r, stdout_w, 2])
            reply, fds, _, _ = socket.recv_fds(sock, 1024, 1)
    except OSError:  # no parent (ended, or never started), or no answer in time
        os.close(stdin_w)
        os.close(stdout_r)
        return None
    finally:
        os.close(stdin_r)
        os.close(stdout_w)
    if not reply or not fds:  # it closed the connection: it failed to fork
        for fd in (stdin_w, stdout_r, *fds):
            os.close(fd)
        return None
    return Forked(json.loads(reply)["pid"], fds[0], stdin_w, stdout_r)


def start_forked_or_fresh(num_workers: int, max_workers: int, spec: str):
    """`start_supervisor` where ENV names a grader parent: forked from it, else started as the package does."""
    return fork_supervisor(num_workers, max_workers, spec) or start_fresh(num_workers, max_workers, spec)


def install() -> bool:
    """In this process, supervisors fork from the grader parent that ENV names (read at each start: a test that
    unsets it gets started ones); False, and nothing replaced, where ENV is unset."""
    if not os.environ.get(ENV):
        return False
    verifier.start_supervisor = start_forked_or_fresh
    return True


def uninstall() -> None:
    verifier.start_supervisor = start_fresh


def _supervise(conn: socket.socket, listener: socket.socket) -> None:
    """Fork one supervisor onto the pipes `conn` brings; tell the asker its pid and a pidfd for it."""
    from trapo.engine.grading.supervisor import _serve

    data, fds, _, _ = socket.recv_fds(conn, _REQUEST_BYTES, 3)
    request = json.loads(data) if len(fds) == 3 else None
    if request is None or (request["package"], request["python"]) != (str(_PACKAGE_PARENT), sys.executable):
        for fd in fds:  # another package's or interpreter's verifier: it starts its own
            os.close(fd)
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            listener.close()
            conn.close()
            os.setsid()  # its own session, as a started supervisor: a Ctrl-C reaches the trainer only
            for target, fd in enumerate(fds):  # stdin, stdout, stderr: the trainer's
                os.dup2(fd, target)
                os.close(fd)
            os.environ.clear()  # read at run time (TRAPO_FAULT, say) as in a started one
            os.environ.update(request["env"])
            _serve(request["workers"], request["max_workers"], "math", warm=False)
            code = 0
        except BaseException:  # noqa: BLE001 - on the trainer's stderr, as a started supervisor's would be
            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)  # before this loop can reap it: the pid cannot have been reused
    try:
        socket.send_fds(conn, [json.dumps({"pid": pid}).encode()], [pidfd])
    finally:
        os.close(pidfd)


def _main(fd: int) -> None:
    from trapo.engine.grading.supervisor import warm_up

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(fileno=fd)  # the owner's, bound and listening
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warnings would reach the owner's terminal
    warm_up()
    gc.collect()
    gc.freeze()  # supervisors share these pages; a collection would otherwise copy them
    while True:
        ready = select.select([listener, sys.stdin], [], [], 1.0)[0]
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the owner closed the lifeline, or died
        if listener in ready:
            conn, _ = listener.accept()
            with conn:
                try:
                    _supervise(conn, listener)
                except OSError:  # the asker gave up (its timeout) or died: nothing to tell it
                    pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:  # no supervisors now
            pass


if __name__ == "__main__":
    _main(int(sys.argv[1]))
