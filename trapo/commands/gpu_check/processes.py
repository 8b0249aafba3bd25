"""A check's process (`make gpu-check`): run to its end within its time limit and the part's budget, its output
captured; on CPU (the dry run) forked from a pre-imported parent where it is a trapo command or a script."""

import os
import signal
import subprocess
import sys
import time

from trapo import runtime
from trapo.commands import fork_server

ROOT = runtime.ROOT
DEADLINE = [float("inf")]  # when the running part's budget ends (time.time())


def shell(cmd: list[str] | str, env: dict, timeout: float, **kw) -> tuple[int, str]:
    """(exit status, stdout + stderr); 124 when it ran past `timeout` seconds or the part's budget (its process
    group killed)."""
    timeout = max(1.0, min(timeout, DEADLINE[0] - time.time()))
    # a trapo module or a script, on CPU: forked from a server that has its imports (none on a GPU)
    forkable = isinstance(cmd, list) and cmd[0] == sys.executable and not kw
    forkable = forkable and ((cmd[1] == "-m" and cmd[2].split(".")[0] == "trapo") or cmd[1].endswith(".py"))
    server = fork_server.server_for(env) if forkable else None
    if server is not None:
        return forked(server, cmd[1:], env, timeout)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        shell=isinstance(cmd, str),
        **kw,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out + f"\n(killed after {timeout:.0f} s)"


def forked(server: fork_server.ForkServer, argv: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """`shell` for a child forked from `server`: its own process group, as a started one's, killed at the timeout."""
    try:
        done = server.run(argv, env, cwd=ROOT, timeout=timeout, merged=True)
    except subprocess.TimeoutExpired as late:
        return 124, late.output + f"\n(killed after {timeout:.0f} s)"
    return done.returncode, done.stdout


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
