"""The study runner's pre-imported parent (trapo/commands/reproduce/forking.py): a sweep's children run as
`python ARGS` would, forked from a parent that did the imports, and are signalled through their pidfds."""

import os
import signal
import subprocess
import tempfile
import time

import pytest

from trapo import runtime
from trapo.commands.reproduce import forking

CHILD = """\
import os, sys
print("preloaded", "deepspeed" in sys.modules, "ppid", os.getppid())
print("cwd", os.getcwd(), "argv", sys.argv[1:], "env", os.environ.get("FORK_TEST"), "name", __name__)
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""

# the pid file appears whole (written aside, then renamed): a reader polling for it never sees it empty
SLOW = (
    "import os, pathlib, time\npathlib.Path('pid.tmp').write_text(str(os.getpid()))\nos.replace('pid.tmp', 'pid')\n"
    "time.sleep(60)\n"
)


@pytest.mark.toy_run  # the parent imports what a trainer imports
def test_a_child_runs_as_python_would_forked_or_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(forking, "_PARENTS", [])  # this test's own parent, started in its environment
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (work / "broken_child.py").write_text("raise ValueError('the child failed')\n")
    (work / "slow_child.py").write_text(SLOW)
    monkeypatch.setenv("FORK_TEST", "seen")  # a child's environment is runtime.subprocess_env() at the call
    try:
        forked = forking.run_python([str(script), "3", "x y"], cwd=work)
        broken = forking.run_python(["-m", "broken_child"], cwd=work)
        parent = forking._PARENTS[0]
        env = runtime.subprocess_env()
        # what the parent's imports set, the caller's imports may set too (MLflow: another session id)
        added = parent.imported_env().keys() - parent.env.keys()
        assert added and parent.takes(env | dict.fromkeys(added, "the caller's own"))
        assert not parent.takes(env | {"FORK_TEST": "changed"}) and parent.takes(env | {"X": "1"}, frozenset({"X"}))
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired) as late:
            parent.run(["slow_child.py"], env, cwd=work, timeout=3)
        assert time.monotonic() - started < 30 and late.value.timeout == 3  # killed with its group at the timeout
        with pytest.raises(ProcessLookupError):
            os.kill(int((work / "pid").read_text()), 0)  # gone, and reaped by the parent before run() raised
        codes = []
        for sig in (signal.SIGTERM, signal.SIGKILL):  # through the child's pidfd, as Popen's methods
            (work / "pid").unlink()
            with tempfile.TemporaryFile() as out:
                child = parent.start(["slow_child.py"], env, out, out, cwd=work)
                while not (work / "pid").is_file():
                    time.sleep(0.02)
                assert child.poll() is None and int((work / "pid").read_text()) == child.pid
                child.terminate() if sig == signal.SIGTERM else child.kill()
                codes.append(child.wait(timeout=30))
                child.kill()  # an ended child is not signalled: no error
        # the caller's environment changed under it (a test's setting, a library the parent lacks): run afresh
        monkeypatch.setenv("FORK_TEST", "changed")
        changed = forking.run_python([str(script), "0"], cwd=work)
    finally:
        for made in forking._PARENTS:
            made.close()
    assert codes == [-signal.SIGTERM, -signal.SIGKILL]
    assert forked.returncode == 3 and forked.stderr == "to stderr\n"
    line1, line2 = forked.stdout.splitlines()
    assert line1.startswith("preloaded True ppid ") and int(line1.split()[-1]) == parent.proc.pid
    assert line2 == f"cwd {work} argv ['3', 'x y'] env seen name __main__"
    assert broken.returncode == 1 and broken.stderr.rstrip().endswith("ValueError: the child failed"), broken.stderr
    assert changed.returncode == 0 and changed.stdout.startswith(f"preloaded False ppid {os.getpid()}"), changed

    monkeypatch.setenv("FORK_TEST", "seen")
    monkeypatch.setenv("TRAPO_FORK_RUNS", "0")  # a fresh interpreter, the same answers
    fresh = forking.run_python([str(script), "3", "x y"], cwd=work)
    assert fresh.returncode == 3 and fresh.stderr == forked.stderr
    assert fresh.stdout.splitlines() == [f"preloaded False ppid {os.getpid()}", line2]
    fresh_broken = forking.run_python(["-m", "broken_child"], cwd=work)
    assert fresh_broken.returncode == 1 and fresh_broken.stderr.splitlines()[-1] == broken.stderr.splitlines()[-1]


def test_a_parent_that_dies_in_its_imports_is_told_apart(tmp_path):
    parent = forking.Parent(runtime.subprocess_env(), tmp_path, ["-c", "raise SystemExit(3)"])
    assert parent.imported_env() is None and not parent.takes(runtime.subprocess_env())
    with pytest.raises(RuntimeError, match="exited in its imports"), tempfile.TemporaryFile() as out:
        parent.start(["x.py"], {}, out, out)
    parent.close()
