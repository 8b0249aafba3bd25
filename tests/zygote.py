"""A pre-imported parent for the tests' trainer processes.

A trainer process spends about 6 s importing torch, transformers, DeepSpeed (and vLLM, 14 s in all) before its
first step, where a toy run's step takes a fraction of a second: the suite's time was mostly imports. Each
pytest worker therefore starts one zygote on first use, a Python process that has imported what a trainer
imports and then only forks. A run is a fork of it, set up as `python -u trapo_train.py ARGS` would be: its
own process and process group, the test's files on its stdout and stderr, its environment, its working
directory and argv, the script run as __main__. Its exit code comes back as a subprocess.Popen's would (minus
the signal for a killed one). The trainer's code is the same; only the imports were done before the fork, in
the environment every test run gets by default (`runtime.subprocess_env()`). A run with any other
environment starts as a plain process (`Zygote.accepts`).

    python -u tests/zygote.py FD     # the zygote itself, on its end of a socket pair
"""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback

# What may differ between the zygote's environment and a run's: the launcher's variables for each rank
# (toyrun.Ranks), read by the trainer at run time, never at import, and the test's name, set by pytest.
PER_RUN = {
    *("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "RANK", "LOCAL_RANK"),
    "PYTEST_CURRENT_TEST",
}


class Zygote:
    """The test side: one zygote process, the runs forked from it, their exit codes as they come."""

    def __init__(self, env: dict[str, str], cwd: str):
        self.env, self.cwd = env, cwd
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.codes: dict[int, int] = {}
        self.ready = False

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a run in `env` can be forked from here: the zygote's environment but for PER_RUN keys."""
        if self.proc.poll() is not None:
            return False
        strip = lambda e: {k: v for k, v in e.items() if k not in PER_RUN}  # noqa: E731
        return strip(env) == strip(self.env)

    def _receive(self, block: bool) -> None:
        while select.select([self.sock], [], [], None if block else 0)[0]:
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("the tests' zygote exited (its stderr is in the test output)")
            message = json.loads(data)
            if "exit" in message:
                self.codes[message["exit"]] = message["code"]
            elif "ready" in message:
                self.ready = True
            else:
                self.started = message["pid"]
            block = False

    def start(self, argv: list[str], env: dict[str, str], out, err, process_group: int) -> "Forked":
        """Fork a run of `argv` (what follows `python`: a script or `-m module`, then the arguments) with `env`,
        writing to the files `out` and `err`; process_group: 0 for a new group led by the run, else the group
        to join."""
        while not self.ready:
            self._receive(block=True)
        request = {"argv": argv, "env": env, "cwd": self.cwd, "pgid": process_group}
        self.started = None
        socket.send_fds(self.sock, [json.dumps(request).encode()], [out.fileno(), err.fileno()])
        while self.started is None:
            self._receive(block=True)
        return Forked(self, self.started, [sys.executable, "-u", *argv])

    def close(self) -> None:
        self.sock.close()  # the zygote exits on EOF; runs still going carry on, as a Popen's children would
        self.proc.wait()


class Forked:
    """A forked run, with the subprocess.Popen methods toyrun.Ranks uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote._receive(block=False)
            self.returncode = self.zygote.codes.pop(self.pid, None)
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
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ----------------------------------------------------------------------------- the zygote's side


def _run_child(sock: socket.socket, request: dict, out: int, err: int) -> None:
    """In the forked child: become the run, then exit with its code (never returns)."""
    code = 1
    try:
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
        atexit._run_exitfuncs()  # the run's own exit handlers, as at a script's end
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def _serve(fd: int) -> None:
    from trapo import runtime

    runtime.configure()
    import deepspeed  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    try:
        import vllm  # noqa: F401
    except ImportError:  # the hf backend only (as on a GPU machine without vLLM)
        pass

    import trapo.commands.train  # noqa: F401
    import trapo.training.trainer  # noqa: F401

    sock = socket.socket(fileno=fd)
    sock.send(json.dumps({"ready": True}).encode())
    running: set[int] = set()
    while True:
        if select.select([sock], [], [], 0.02)[0]:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 65536, 2)
            except OSError:
                data = b""
            if not data:
                return  # the test side closed: runs still going are left to finish
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
    except (BrokenPipeError, ConnectionResetError):  # the test side is gone: nothing left to tell it
        pass
