"""Graders outlive their processes (trapo/engine/grading/verifier.py, supervisor.py): an executor or the
supervisor killed while an item is in flight costs no verdict, nothing is remembered as slow for it, a
replacement supervisor that dies while starting is retried, and what still cannot be decided is FAILED, never
an exception. The items are held in flight deterministically: the executors are stopped (SIGSTOP) before the
request, so the item sits in an executor's pipe until the test kills that executor or the supervisor."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from forking import graders

from trapo.algorithm.rewards import Verdict
from trapo.engine.grading import verifier as verifier_module
from trapo.engine.grading.verifier import MathVerifier

PAIRS = [("\\frac{1}{2}", "0.5"), ("3", "4"), ("x^2+2x+1", "(x+1)^2")]
RIGHT = [Verdict.EQUAL, Verdict.NOT_EQUAL, Verdict.EQUAL]


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def blocked_on_a_pipe(pid: int) -> bool:
    with open(f"/proc/{pid}/wchan") as f:
        return "pipe" in f.read()


def in_flight(verifier: MathVerifier, pairs, timeout=20.0):
    """Start judge_many(pairs) in a thread with every executor stopped; returns (thread, results, executors)."""
    verifier.start()
    executors = children(verifier._supervisor.proc.pid)
    for pid in executors:  # idle: blocked reading their pipe (past their set-up, which a stop could freeze)
        waited = time.monotonic() + 3.0  # where the kernel hides wchan ("0"), 3 s is set-up many times over
        while not blocked_on_a_pipe(pid) and time.monotonic() < waited:
            time.sleep(0.01)
    for pid in executors:
        os.kill(pid, signal.SIGSTOP)
    results = {}
    thread = threading.Thread(target=lambda: results.update(v=verifier.judge_many(pairs, timeout=timeout)))
    thread.start()
    time.sleep(0.5)  # the supervisor has placed the items; they wait in the stopped executors' pipes
    return thread, results, executors


@pytest.fixture
def verifier():
    v = MathVerifier(num_workers=2, timeout=20.0)
    yield v
    v.close()


def test_an_executor_killed_mid_item_costs_no_verdict_and_marks_nothing_slow(verifier):
    thread, results, executors = in_flight(verifier, PAIRS)
    os.kill(executors[0], signal.SIGKILL)  # the OOM killer's pick
    for pid in executors[1:]:
        os.kill(pid, signal.SIGCONT)
    thread.join(60)
    assert results["v"] == RIGHT
    assert verifier.timeouts == 0 and verifier.failed == 0
    assert verifier.memory() == {"answers": {}, "pairs": []}  # a death is no timeout: no gold marked slow
    assert verifier.judge_many([("\\frac{1}{2}", "1/2")]) == [Verdict.EQUAL]  # the same gold, later


def test_an_item_whose_executor_dies_twice_is_failed_not_timed_out(monkeypatch):
    """The grader_crash fault (trapo/faults.py): every executor given its gold kills itself, so each try dies."""
    from trapo import faults

    monkeypatch.setenv(faults.VARIABLE, "grader_crash")  # the supervisor and its executors inherit it
    verifier = MathVerifier(num_workers=2, timeout=20.0)
    try:
        verdicts = verifier.judge_many([(faults.GRADER_CRASH_GOLD, "1"), ("7", "7"), ("7", "8")])
        assert verdicts == [Verdict.FAILED, Verdict.EQUAL, Verdict.NOT_EQUAL]
        assert verifier.failed == 1 and verifier.timeouts == 0 and verifier.memory()["answers"] == {}
        assert verifier.judge_many([("7", "7")]) == [Verdict.EQUAL]  # the next request: workers live again
    finally:
        verifier.close()


def test_a_supervisor_killed_mid_request_is_replaced_and_its_items_rerun(verifier, caplog):
    verifier.load_memory({"answers": {"slow": 20.0}, "pairs": []})  # e.g. from a checkpoint
    thread, results, _ = in_flight(verifier, PAIRS)
    first = verifier._supervisor.proc.pid
    os.kill(first, signal.SIGKILL)  # its executors die with it (PDEATHSIG)
    thread.join(120)
    assert results["v"] == RIGHT and verifier.timeouts == 0 and verifier.failed == 0
    assert verifier._supervisor.proc.pid != first
    assert "exceeded" not in caplog.text  # no phantom timeouts
    # the replacement got the memory: a remembered slow gold is answered at once, as before the death
    assert verifier.judge_many([("slow", "1")]) == [Verdict.GOLD_TIMEOUT]


def test_replacements_that_die_while_starting_are_retried_then_items_fail_without_an_exception(monkeypatch):
    # started supervisors: each spends its imports' second starting, where the killer below finds it (one forked
    # from the test suite's grader parent is ready in milliseconds)
    monkeypatch.delenv(graders.ENV, raising=False)
    # the waits between tries shortened (7 s in all): what is tested is that each try is made, then the items fail
    monkeypatch.setattr(verifier_module, "_RESTART_WAITS", (0.1, 0.2, 0.4))
    verifier = MathVerifier(num_workers=2, timeout=20.0)
    try:
        _replacements_die(verifier)
    finally:
        verifier.close()


def _replacements_die(verifier):
    thread, results, _ = in_flight(verifier, PAIRS)
    first = verifier._supervisor.proc.pid
    stop = threading.Event()

    def killer():  # the first supervisor, and every replacement while it imports Math-Verify
        while not stop.is_set():
            sup = verifier._supervisor
            if sup is not None and sup.proc.poll() is None:
                os.kill(sup.proc.pid, signal.SIGKILL)
            time.sleep(0.05)

    k = threading.Thread(target=killer)
    k.start()
    thread.join(120)
    stop.set()
    k.join()
    assert results["v"] == [Verdict.FAILED] * 3 and verifier.failed == 3 and verifier.timeouts == 0
    assert verifier.judge_many(PAIRS) == RIGHT  # the next request starts a supervisor that lives
    assert verifier._supervisor.proc.pid != first


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "started"])
def test_a_first_supervisor_killed_while_starting_is_retried_and_the_verdicts_come_back(forked, monkeypatch, caplog):
    """The grader_first_start fault (trapo/faults.py): the first supervisor kills itself while warming up, as
    the out-of-memory killer would, whether forked from the test suite's grader parent or started as in a
    user's run."""
    from trapo import faults

    if not forked:
        monkeypatch.delenv(graders.ENV, raising=False)
    monkeypatch.setenv(faults.VARIABLE, "grader_first_start")  # the first supervisor inherits it
    started = []
    start = verifier_module.start_supervisor
    monkeypatch.setattr(verifier_module, "start_supervisor", lambda *a: started.append(start(*a)) or started[-1])
    verifier = MathVerifier(num_workers=2, timeout=20.0)
    try:
        assert verifier.judge_many(PAIRS) == RIGHT
        assert len(started) == 2 and started[0].poll() is not None  # it died at start-up, then a retry
        if not forked:  # a forked one's exit status goes to the grader parent
            assert started[0].wait() == -signal.SIGKILL
        assert verifier.failed == 0 and verifier.timeouts == 0
        assert "failed to start" in caplog.text and "trying again" in caplog.text
        assert faults.VARIABLE not in os.environ  # one-shot: spent by the start it killed
    finally:
        verifier.close()


def test_a_first_supervisor_that_fails_to_start_twice_ends_in_one_line(monkeypatch):
    """A broken installation: every supervisor exits before it is ready. The first start is retried once, then
    one line names the cause and the fix."""
    tries = []

    def broken(num_workers, max_workers, spec):
        tries.append(spec)
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.exit(1)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    monkeypatch.setattr(verifier_module, "start_supervisor", broken)
    verifier = MathVerifier(num_workers=2, timeout=20.0)
    try:
        with pytest.raises(verifier_module.GraderStartError) as raised:
            verifier.judge_many(PAIRS)
    finally:
        verifier.close()
    assert len(tries) == 2  # retried once, as a killed start would be
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("Math-Verify failed to start twice in a row: Math-Verify worker exited at start-up")
    assert "is math-verify installed?" in message and "-m trapo.engine.grading.supervisor" in message
