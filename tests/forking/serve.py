"""The tests' pre-imported parent (servers.py): the study runner's parent loop (trapo/commands/reproduce/forking.py)
with two things put in place first, which every forked child inherits:

- the grader parent's seam (graders.py): the Math-Verify supervisors of every forked trainer fork from the test
  session's grader parent;
- a sweep's own parent forked at once: a child that runs `python -m trapo reproduce` (a test's sweep) gets, before
  its first line runs, a parent forked from it while it is still a copy of this one (the imports made, no torch op
  run), instead of starting one that makes the imports again at its first run (`_become_with_its_parent`).

    python -u tests/forking/serve.py FD
"""

import os
import socket
import sys
import threading

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `forking`

from forking import graders  # noqa: E402
from trapo.commands.reproduce import forking  # noqa: E402

SWEEP = ["-m", "trapo", "reproduce"]


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
        os.setpgid(0, request["pgid"])  # first: the parent is in the runner's process group, as its runs are
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the sweep's parent: in the runner's environment and folder, serving its end of the pair
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
        forking._PARENTS[:] = [ForkedParent(request["env"], request["cwd"], pid, mine)]
    _become(request, out, err, held)


graders.install()
_become, forking._become = forking._become, _become_with_its_parent
forking.serve(int(sys.argv[1]))
