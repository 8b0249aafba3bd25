"""The fork server: a sweep's children run as `python ARGS` would, forked from a parent that did the imports."""

import os
import subprocess
import time

import pytest

from trapo import runtime
from trapo.commands import fork_server

CHILD = """\
import os, sys
print("preloaded", "deepspeed" in sys.modules, "ppid", os.getppid())
print("cwd", os.getcwd(), "argv", sys.argv[1:], "env", os.environ.get("FORK_TEST"), "name", __name__)
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.toy_run  # the server imports what a trainer imports
def test_a_child_runs_as_python_would_forked_or_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(fork_server, "_SERVERS", [])  # this test's own server, started in its environment
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "broken_child.py").write_text("raise ValueError('the child failed')\n")
    monkeypatch.setenv("FORK_TEST", "seen")  # a child's environment is runtime.subprocess_env() at the call
    try:
        forked = fork_server.run_python([str(script), "3", "x y"], cwd=tmp_path / "work")
        broken = fork_server.run_python(["-m", "broken_child"], cwd=tmp_path / "work")
        slow = tmp_path / "work" / "slow_child.py"
        slow.write_text("import os, pathlib, time\npathlib.Path('pid').write_text(str(os.getpid()))\ntime.sleep(60)\n")
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            fork_server._SERVERS[0].run([str(slow)], runtime.subprocess_env(), cwd=tmp_path / "work", timeout=3)
        assert time.monotonic() - started < 30  # killed with its group at the timeout, not waited for
        pid = int((tmp_path / "work" / "pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, and reaped by the server before run() raised
    finally:
        for server in fork_server._SERVERS:
            server.close()
    assert forked.returncode == 3 and forked.stderr == "to stderr\n"
    line1, line2 = forked.stdout.splitlines()
    assert line1.startswith("preloaded True ppid ") and int(line1.split()[-1]) != os.getpid()  # the server's
    assert line2 == f"cwd {tmp_path / 'work'} argv ['3', 'x y'] env seen name __main__"
    assert broken.returncode == 1 and broken.stderr.rstrip().endswith("ValueError: the child failed"), broken.stderr

    monkeypatch.setenv("TRAPO_FORK_RUNS", "0")  # a fresh interpreter, the same answers
    fresh = fork_server.run_python([str(script), "3", "x y"], cwd=tmp_path / "work")
    assert fresh.returncode == 3 and fresh.stderr == forked.stderr
    assert fresh.stdout.splitlines() == [f"preloaded False ppid {os.getpid()}", line2]
    fresh_broken = fork_server.run_python(["-m", "broken_child"], cwd=tmp_path / "work")
    assert fresh_broken.returncode == 1 and fresh_broken.stderr.splitlines()[-1] == broken.stderr.splitlines()[-1]
