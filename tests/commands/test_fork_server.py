"""The fork server: a sweep's children run as `python ARGS` would, forked from a parent that did the imports."""

import os
import signal
import subprocess
import sys
import tempfile
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

GRADING_CHILD = """
from trapo.engine.grading.verifier import MathVerifier
verifier = MathVerifier(num_workers=1)
verdicts = verifier.judge_many([("x^2+2x+1", "(x+1)^2")])
print(type(verifier._supervisor.proc).__name__, verdicts)
verifier.close()
"""

NESTED_CHILD = """
import os, sys
from trapo.commands import fork_server
inner = fork_server.run_python([sys.argv[1], "0"], cwd=os.getcwd())
inner_parent = inner.stdout.split()[3]  # the grandchild's first line: preloaded True ppid PID
print("servers", len(fork_server._SWEEP_SERVERS), "parent", os.getppid(), "inner", inner.returncode, inner_parent)
"""

RANK = """
import sys
from trapo.commands import fork_server
code = fork_server.forward(sys.argv[1:])
if code is None:
    print("not forwarded", file=sys.stderr)
sys.exit(99 if code is None else code)
"""


@pytest.mark.toy_run  # the server imports what a trainer imports
def test_a_child_runs_as_python_would_forked_or_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(fork_server, "_SWEEP_SERVERS", [])  # this test's own servers, started in its environment

    def sweep_env():  # what run_python gives its children
        return runtime.subprocess_env()

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "broken_child.py").write_text("raise ValueError('the child failed')\n")
    monkeypatch.setenv("FORK_TEST", "seen")  # a child's environment is runtime.subprocess_env() at the call
    try:
        forked = fork_server.run_python([str(script), "3", "x y"], cwd=tmp_path / "work")
        broken = fork_server.run_python(["-m", "broken_child"], cwd=tmp_path / "work")
        (tmp_path / "work" / "nested_child.py").write_text(NESTED_CHILD)
        nested = fork_server.run_python(["nested_child.py", str(script)], cwd=tmp_path / "work")
        (tmp_path / "work" / "grading_child.py").write_text(GRADING_CHILD)
        grading = fork_server.run_python(["grading_child.py"], cwd=tmp_path / "work")
        slow = tmp_path / "work" / "slow_child.py"
        slow.write_text("import os, pathlib, time\npathlib.Path('pid').write_text(str(os.getpid()))\ntime.sleep(60)\n")
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            server = fork_server._sweep_servers().server(sweep_env())
            server.run([str(slow)], sweep_env(), cwd=tmp_path / "work", timeout=3)
        assert time.monotonic() - started < 30  # killed with its group at the timeout, not waited for
        pid = int((tmp_path / "work" / "pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, and reaped by the server before run() raised
        # a launcher's rank under that server hands its run to a child forked there and stands in for it
        rank, slow_rank = _stand_ins(tmp_path / "work", script, slow, sweep_env())
        # what the server's imports set, the caller's imports may set too (MLflow: another session id)
        server = fork_server._sweep_servers().server(sweep_env())
        assert not server.idle()  # promised to this caller's child: another thread's pool call may not close it
        with tempfile.TemporaryFile() as out:
            child = server.start([str(script), "0"], sweep_env(), out, out, 0)
            assert not server.idle()  # its exit code is still to come: closing the server would lose it
            assert child.wait(timeout=30) == 0 and server.idle()
        added = server.imported_env.keys() - server.env.keys()
        assert added and server.accepts(sweep_env() | dict.fromkeys(added, "the caller's own"))
        # what the deepspeed launcher gives a rank: its device list, its working directory on PYTHONPATH again
        launched = sweep_env() | {"CUDA_VISIBLE_DEVICES": "0", "RANK": "1"}
        launched["PYTHONPATH"] = os.pathsep.join([str(runtime.ROOT), launched["PYTHONPATH"]])
        assert server.accepts(launched)
        assert not server.accepts(launched | {"PYTHONPATH": os.pathsep.join([str(tmp_path), launched["PYTHONPATH"]])})
        # the caller's environment changed under it otherwise (a test's setting, a library the server lacks): a
        # server of its own
        monkeypatch.setenv("FORK_TEST", "changed")
        changed = fork_server.run_python([str(script), "0"], cwd=tmp_path / "work")
        assert len(fork_server._sweep_servers().servers) == 2
    finally:
        for servers in fork_server._SWEEP_SERVERS:
            servers.close()
    # a forked run grades: its Math-Verify supervisor starts as a user's run starts it
    assert grading.stdout == "Popen [<Verdict.EQUAL: '1'>]\n", grading.stdout + grading.stderr
    assert changed.returncode == 0 and changed.stdout.startswith("preloaded True ppid "), changed
    assert "argv ['0'] env changed" in changed.stdout
    assert forked.returncode == 3 and forked.stderr == "to stderr\n"
    line1, line2 = forked.stdout.splitlines()
    assert line1.startswith("preloaded True ppid ") and int(line1.split()[-1]) != os.getpid()  # the server's
    assert line2 == f"cwd {tmp_path / 'work'} argv ['3', 'x y'] env seen name __main__"
    assert broken.returncode == 1 and broken.stderr.rstrip().endswith("ValueError: the child failed"), broken.stderr
    assert rank.returncode == 4 and rank.stderr == "to stderr\n", rank.stderr  # its output and exit code, forked:
    assert rank.stdout.splitlines() == [line1, line2.replace("['3', 'x y']", "['4', 'x y']")]
    assert slow_rank == (-signal.SIGTERM, True), slow_rank  # a SIGTERM passed on, then a kill -9 that ends both
    # a child's own children (a sweep forked from a server) fork from its server: it starts none of its own
    _, servers, _, parent, _, code, inner_parent = nested.stdout.split()
    assert (servers, code, inner_parent) == ("0", "0", parent) and parent == line1.split()[-1], nested

    monkeypatch.setenv("FORK_TEST", "seen")
    monkeypatch.setenv("TRAPO_FORK_RUNS", "0")  # a fresh interpreter, the same answers
    fresh = fork_server.run_python([str(script), "3", "x y"], cwd=tmp_path / "work")
    assert fresh.returncode == 3 and fresh.stderr == forked.stderr
    assert fresh.stdout.splitlines() == [f"preloaded False ppid {os.getpid()}", line2]
    fresh_broken = fork_server.run_python(["-m", "broken_child"], cwd=tmp_path / "work")
    assert fresh_broken.returncode == 1 and fresh_broken.stderr.splitlines()[-1] == broken.stderr.splitlines()[-1]


def _stand_ins(work, script, slow, env):
    """A rank (work/rank.py) run fresh under the sweep's server, standing in for `script`; then two for `slow`:
    one sent SIGTERM (its exit code), one killed with SIGKILL (whether its child died too)."""
    server = fork_server._sweep_servers().running(env)
    env = env | {fork_server.NAME_ENV: server.name}
    (work / "rank.py").write_text(RANK)
    rank = subprocess.run(
        [sys.executable, "-u", "rank.py", str(script), "4", "x y"], cwd=work, env=env, capture_output=True, text=True
    )
    codes = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        (work / "pid").unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-u", "rank.py", str(slow)], cwd=work, env=env)
        deadline = time.monotonic() + 60
        while not (work / "pid").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int((work / "pid").read_text())
        proc.send_signal(sig)
        codes.append(proc.wait(timeout=30))
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}"):  # reaped by the server once it died
        time.sleep(0.05)
    return rank, (codes[0], codes[1] == -signal.SIGKILL and not os.path.exists(f"/proc/{child}"))


def test_an_environment_gets_its_server_after_its_fresh_first_children_and_an_idle_one_makes_room(monkeypatch):
    started = []
    monkeypatch.setattr(fork_server, "ForkServer", lambda env, cwd, per_run: started.append(env) or _StandIn(env))
    servers = fork_server.ForkServers("/", per_run=frozenset({"RANK"}), fresh_first=1, limit=2)
    a, a_rank1, b, c, d = {"X": "a"}, {"X": "a", "RANK": "1"}, {"X": "b"}, {"X": "c"}, {"X": "d"}
    assert servers.server(a) is None  # the first child of an environment starts afresh
    server_a = servers.server(a_rank1)
    assert server_a.env == a and started == [a]  # the second: its server, without per-run keys
    assert servers.server(a) is server_a and len(started) == 1
    assert servers.server(b) is None
    server_b = servers.server(b)
    server_a.busy = True  # a child of a's still runs: a stays, though used less recently than b
    assert servers.server(c) is None
    server_c = servers.server(c)  # room made: the least recently used idle server closed
    assert server_c.env == c and server_b.closed and not server_a.closed and servers.servers == [server_a, server_c]
    server_c.busy = True
    assert [servers.server(d), servers.server(d)] == [None, None] and len(started) == 3  # none idle: d stays fresh
    server_a.alive = False  # a server that died: its children start afresh
    assert servers.server(a) is None and servers.fresh[frozenset(a.items())] == 2


class _StandIn:
    """A server for the pool's bookkeeping alone (a real one is tested above)."""

    def __init__(self, env):
        self.env, self.alive, self.busy, self.closed = env, True, False, False

    def accepts(self, env):
        return self.alive and {k: v for k, v in env.items() if k != "RANK"} == self.env

    def idle(self):
        return not self.busy

    def promise(self):
        pass

    def close(self):
        self.closed = True
