"""The fork server's process (trapo/commands/fork_server/__init__.py is its callers' side): the imports, then a
loop that forks each request's child and reports its pid and exit code to the caller that asked.

    python -u -m trapo.commands.fork_server.serve FD [VAR ...]   # on its end of a socket pair; VAR: per_run
"""

import atexit
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback

from trapo import runtime
from trapo.commands.fork_server import NAME_ENV


def _run_child(socks: list[socket.socket], name: str, request: dict, out: int, err: int, lifeline=None) -> None:
    """In the forked child: become `python ARGS`, then exit with its code (never returns). `lifeline`: the read end
    of a pipe whose caller (`fork_server.forward`) stands in for this child; its end closing ends the child."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter (the server ignores it)
        for sock in socks:
            sock.close()
        if lifeline is not None:
            threading.Thread(target=_die_with, args=(lifeline,), daemon=True).start()
        os.setpgid(0, request["pgid"])
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[NAME_ENV] = name
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


def _die_with(lifeline: int) -> None:
    """Block until the caller's end of `lifeline` closes (its exit, or a kill -9 of it), then die the same way."""
    while os.read(lifeline, 1):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def preload() -> None:
    """What a trainer, `trapo eval` and their vLLM engine import, imported here once for every child."""
    runtime.configure()
    from trapo.engine.dist import import_deepspeed

    import_deepspeed()  # as the trainer does: without MLflow's import (1.5 s), which a child makes if it logs there
    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    try:
        # vllm.LLM is a lazy attribute, and the engine picks its CPU worker by name: each would be ~4 s of CPU
        # in every child that starts an engine (the server runs on CPU only)
        from vllm import LLM, SamplingParams  # noqa: F401
        from vllm.inputs import TokensPrompt  # noqa: F401
        from vllm.v1.worker import cpu_worker  # noqa: F401
    except ImportError:  # the hf backend only (as on a GPU machine without vLLM)
        pass

    import trapo.commands.eval  # noqa: F401
    import trapo.commands.train  # noqa: F401
    import trapo.training.trainer  # noqa: F401


def _serve(fd: int, per_run: list[str]) -> None:
    started_in = dict(os.environ)
    preload()
    gc.collect()
    gc.freeze()  # the children's collections skip what the imports made: ~0.3 s of CPU each in a toy run

    # Ctrl-C in the caller's terminal is for the caller and the children: the server ends when the caller
    # closes its socket (children still running or not), once the callers its children connected have closed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    owner = socket.socket(fileno=fd)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # for its children's calls (NAME_ENV)
    name = f"trapo-fork-server-{os.getpid()}-{os.urandom(4).hex()}"
    listener.bind("\0" + name)  # abstract: nothing on disk, gone with the server
    listener.listen()
    greeting = {
        "ready": True,
        "env": dict(os.environ),
        "base": started_in,
        "per_run": per_run,
        "sid": os.getsid(0),
        "name": name,
    }
    owner.send(json.dumps(greeting).encode())
    callers = [owner]
    running: dict[int, socket.socket] = {}  # each child's caller, told its exit code
    while callers:
        watched = [*callers, listener] if owner in callers else callers  # no new callers once the owner closed
        for conn in select.select(watched, [], [], 0.02)[0]:
            if conn is listener:
                caller, _ = listener.accept()
                callers.append(caller)
                _tell(caller, greeting)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
            except OSError:
                data = b""
            if not data:  # that caller closed; children still going are left to finish
                callers.remove(conn)
                conn.close()
                if conn is owner:
                    listener.close()  # its name is free: a late child's call finds no server, and starts its own
                continue
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child([*callers, listener], name, request, *fds)
            try:  # here too, as a shell does: the group exists before the next rank asks to join it
                os.setpgid(pid, request["pgid"] or pid)
            except OSError:  # the child got there first
                pass
            for f in fds:
                os.close(f)
            running[pid] = conn
            _tell(conn, {"pid": pid}, conn is owner)
        for pid, caller in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[pid]
                if caller in callers:
                    _tell(caller, {"exit": pid, "code": os.waitstatus_to_exitcode(status)}, caller is owner)


def _tell(conn: socket.socket, message: dict, owner: bool = False) -> None:
    """A message to a caller; one of the children's callers may be gone (the owner's loss ends the server)."""
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        if owner:
            raise


if __name__ == "__main__":
    try:
        _serve(int(sys.argv[1]), sys.argv[2:])
    except (BrokenPipeError, ConnectionResetError):  # the caller is gone: nothing left to tell it
        pass
