"""Math-Verify supervisors forked from the tests' grader parent (tests/forking/graders.py) grade as started ones
do, live and die as started ones do, and a verifier without a parent that answers starts its own."""

import time

import pytest
from forking import graders
from forking.graders import ENV, Forked, GraderParent

from trapo.algorithm.rewards import Verdict
from trapo.engine.grading import verifier as verifier_module
from trapo.engine.grading.verifier import MathVerifier

# plain, symbolic, and degenerate pairs whose verdict follows the hash seed (tests/algorithm/test_extraction.py)
PAIRS = [
    ("\\frac{1}{2}", "0.5"),
    ("3", "4"),
    ("x^2+2x+1", "(x+1)^2"),
    ("0", "4 0/0"),
    ("1", "1/0"),
    ("0", "0 \\cdot \\infty"),
    ("\\{1,2\\}", "\\{2,1\\}"),
]


def environ(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().split(b"\0")


def ended(proc, within: float = 10.0) -> bool:
    waited = time.monotonic() + within
    while proc.poll() is None and time.monotonic() < waited:
        time.sleep(0.02)
    return proc.poll() is not None


@pytest.fixture
def own_parent(monkeypatch):
    """A grader parent of this test's own (asked for at once: before its imports are done), named in the
    environment, and this process's supervisors started through it."""
    parent = GraderParent()
    monkeypatch.setenv(ENV, parent.name)
    monkeypatch.setattr(verifier_module, "start_supervisor", verifier_module.start_supervisor)  # restored after
    assert graders.install()
    yield parent
    parent.close()


def test_the_suites_verifiers_fork_from_its_grader_parent(grader_parent):
    if grader_parent is None:
        pytest.skip("TRAPO_TESTS_FORK=0: no grader parent this session")
    verifier = MathVerifier(num_workers=1)
    try:
        verifier.start()
        assert isinstance(verifier._supervisor.proc, Forked)  # conftest installed the parent in this process
        assert verifier.judge_many(PAIRS[:1]) == [Verdict.EQUAL]
    finally:
        verifier.close()


def test_install_needs_a_parent_named_and_replaces_the_one_start(monkeypatch):
    monkeypatch.setattr(verifier_module, "start_supervisor", graders.start_fresh)
    monkeypatch.delenv(ENV, raising=False)
    assert not graders.install() and verifier_module.start_supervisor is graders.start_fresh
    monkeypatch.setenv(ENV, "no-such-parent")
    assert graders.install() and verifier_module.start_supervisor is graders.start_forked_or_fresh
    graders.uninstall()
    assert verifier_module.start_supervisor is graders.start_fresh


def test_a_forked_supervisor_grades_as_a_started_one(own_parent, monkeypatch):
    forked = MathVerifier(num_workers=1)
    try:
        forked.start()  # the parent is still importing: the request waits for it rather than starting one
        assert isinstance(forked._supervisor.proc, Forked)
        assert b"PYTHONHASHSEED=0" in environ(forked._supervisor.proc.pid)  # the parent's seed, a started one's
        via_parent = forked.judge_many(PAIRS)
    finally:
        forked.close()
    monkeypatch.delenv(ENV)
    started = MathVerifier(num_workers=1)
    try:
        started.start()
        assert not isinstance(started._supervisor.proc, Forked)
        assert started.judge_many(PAIRS) == via_parent
    finally:
        started.close()
    assert via_parent[:3] == [Verdict.EQUAL, Verdict.NOT_EQUAL, Verdict.EQUAL]


def test_a_forked_supervisor_ends_with_its_pipe_and_a_killed_one_is_replaced_from_the_parent(own_parent):
    verifier = MathVerifier(num_workers=1)
    try:
        verifier.start()
        first = verifier._supervisor.proc
        first.kill()
        assert ended(first)
        assert verifier.judge_many(PAIRS[:2]) == [Verdict.EQUAL, Verdict.NOT_EQUAL]  # a replacement, forked too
        second = verifier._supervisor.proc
        assert isinstance(second, Forked) and second.pid != first.pid
        second.stdin.close()  # as when the trainer exits: the supervisor sees the end of its input and ends
        assert ended(second)
    finally:
        verifier.close()


def test_without_an_answering_parent_the_verifier_starts_its_own(monkeypatch):
    parent = GraderParent()
    parent.close()  # its lifeline closed: it ended, and its name with it
    assert ended(parent.proc)
    monkeypatch.setenv(ENV, parent.name)
    monkeypatch.setattr(verifier_module, "start_supervisor", verifier_module.start_supervisor)
    assert graders.install()
    assert graders.fork_supervisor(1, 8, "math") is None
    verifier = MathVerifier(num_workers=1)
    try:
        assert verifier.judge_many(PAIRS[:1]) == [Verdict.EQUAL]
        assert not isinstance(verifier._supervisor.proc, Forked)
    finally:
        verifier.close()


def test_a_task_verifier_is_never_forked(own_parent):
    # it imports the user's module, from the trainer's directory and path: the parent has neither
    assert graders.fork_supervisor(1, 8, "digits_verifier:Digits") is None
    forked = graders.fork_supervisor(1, 8, "math")  # while the default one is
    assert isinstance(forked, Forked)
    forked.stdin.close()  # the end of its input: it ends
    assert ended(forked)
