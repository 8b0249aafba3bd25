"""A check's process (`make gpu-check`): run to its end within its time limit and the part's budget, its output
captured."""

import os
import signal
import subprocess
import time

from trapo import runtime

ROOT = runtime.ROOT
DEADLINE = [float("inf")]  # when the running part's budget ends (time.time())


def shell(cmd: list[str] | str, env: dict, timeout: float, **kw) -> tuple[int, str]:
    """(exit status, stdout + stderr); 124 when it ran past `timeout` seconds or the part's budget (its process
    group killed)."""
    timeout = max(1.0, min(timeout, DEADLINE[0] - time.time()))
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


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
