"""The tests' pre-imported parent (servers.py): the study runner's parent loop (trapo/commands/reproduce/forking.py)
with two things put in place first, which every forked child inherits:

- the grader parent's seam (graders.py): the Math-Verify supervisors of every forked trainer fork from the test
  session's grader parent;
- a sweep's own parent forked at once: a child that runs `python -m trapo reproduce` (a test's sweep) gets, before
  its first line runs, a parent forked from it while it is still a copy of this one (the imports made, no torch op
  run), instead of starting one that makes the imports again at its first run (`_become_with_its_parent`);
- the same for `python -m trapo gpu-check` and `gpu-bench` (their dry runs), whose checks' Python processes
  (`gpu_check.processes.shell`) are then forked from that parent instead of each making the imports again
  (`_checks_forked`); what is not a Python process (nvidia-smi, `python -c`) still starts afresh.

    python -u tests/forking/serve.py FD
"""

import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `forking`

from forking import graders  # noqa: E402
from forking.servers import IMPORT_SET, STARTUP_VARS  # noqa: E402
from trapo.commands.reproduce import forking  # noqa: E402

SWEEP = ["-m", "trapo", "reproduce"]
GPU_CHECKS = (["-m", "trapo", "gpu-check"], ["-m", "trapo", "gpu-bench"])


class ForkedParent(forking.Parent):
    """A sweep's parent that is a fork of the sweep's runner (its child), made before the runner ran anything."""

    def __init__(self, env: dict[str, str], cwd: str, pid: int, control: socket.socket):
        self.env, self.cwd, self.control, self.proc = dict(env), cwd, control, _Child(pid)
        self.lock = threading.Lock()
        self._imported_env = None


class _Child:
    """The forked parent's process, as Parent reads a Popen: poll() and wait()."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _become_with_its_parent(request: dict, out: int, err: int, held: list[int]) -> None:
    if request["argv"][:3] == SWEEP:
        forking._PARENTS[:] = [_forked_parent(request, out, err, held)]
    elif request["argv"][:3] in GPU_CHECKS:
        _checks_forked(_forked_parent(request, out, err, held))
    _become(request, out, err, held)


def _forked_parent(request: dict, out: int, err: int, held: list[int]) -> ForkedParent:
    """A parent forked from this child before it runs anything, in its process group, environment and folder."""
    os.setpgid(0, request["pgid"])  # first: the parent is in the child's process group, as its children are
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # the parent: in the child's environment and folder, serving its end of the pair
        try:
            for fd in [*held, out, err]:
                os.close(fd)
            mine.close()
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            forking.serve(theirs.detach())
        finally:
            os._exit(0)
    theirs.close()
    return ForkedParent(request["env"], request["cwd"], pid, mine)


def _checks_forked(parent: ForkedParent) -> None:
    """gpu-check's and gpu-bench's `shell` (gpu_check/processes.py) forking each check that is a Python script or
    module (`python -m trapo doctor`, `python -m deepspeed.launcher.runner ...`, `python bench/...py`) from
    `parent`, with the same result: exit status and merged output, the check's own process group killed at its
    time limit (124). Anything else, or a check whose environment the parent does not take, starts afresh."""
    from trapo.commands import gpu_check
    from trapo.commands.gpu_check import bench, processes

    fresh = processes.shell

    def shell(cmd, env, timeout, **kw):
        python = isinstance(cmd, list) and len(cmd) > 1 and cmd[0] == sys.executable and cmd[1] != "-c"
        if kw or not python or not parent.takes(env, IMPORT_SET | STARTUP_VARS):
            return fresh(cmd, env, timeout, **kw)
        timeout = max(1.0, min(timeout, processes.DEADLINE[0] - time.time()))
        try:
            done = parent.run(cmd[1:], env, cwd=processes.ROOT, timeout=timeout, merged=True)
        except subprocess.TimeoutExpired as late:
            return 124, (late.stdout or "") + f"\n(killed after {timeout:.0f} s)"
        return done.returncode, done.stdout

    for module in (processes, gpu_check, bench):
        module.shell = shell


graders.install()
_become, forking._become = forking._become, _become_with_its_parent
forking.serve(int(sys.argv[1]))
