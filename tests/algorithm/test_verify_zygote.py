"""Math-Verify supervisors forked from a warm zygote (trapo/algorithm/rewards/verify_zygote.py) grade as started
ones do, live and die as started ones do, and a verifier without a zygote that answers starts its own."""

import time

import pytest

from trapo.algorithm.rewards import verify_zygote
from trapo.algorithm.rewards.verifier import MathVerifier, Verdict
from trapo.algorithm.rewards.verify_zygote import ENV, Forked, Zygote

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
def own_zygote(monkeypatch):
    """A zygote of this test's own (asked for at once: before its imports are done), named in the environment."""
    zygote = Zygote()
    monkeypatch.setenv(ENV, zygote.name)
    yield zygote
    zygote.close()


def test_a_forked_supervisor_grades_as_a_started_one(own_zygote, monkeypatch):
    forked = MathVerifier(num_workers=1)
    try:
        forked.start()  # the zygote is still importing: the request waits for it rather than starting one
        assert isinstance(forked._supervisor.proc, Forked)
        assert b"PYTHONHASHSEED=0" in environ(forked._supervisor.proc.pid)  # the zygote's seed, a started one's
        via_zygote = forked.judge_many(PAIRS)
    finally:
        forked.close()
    monkeypatch.delenv(ENV)
    started = MathVerifier(num_workers=1)
    try:
        started.start()
        assert not isinstance(started._supervisor.proc, Forked)
        assert started.judge_many(PAIRS) == via_zygote
    finally:
        started.close()
    assert via_zygote[:3] == [Verdict.EQUAL, Verdict.NOT_EQUAL, Verdict.EQUAL]


def test_a_forked_supervisor_ends_with_its_pipe_and_a_killed_one_is_replaced_from_the_zygote(own_zygote):
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


def test_without_an_answering_zygote_the_verifier_starts_its_own(monkeypatch):
    zygote = Zygote()
    zygote.close()  # its lifeline closed: it ended, and its name with it
    assert ended(zygote.proc)
    monkeypatch.setenv(ENV, zygote.name)
    assert verify_zygote.fork_supervisor(1, 8, "math") is None
    verifier = MathVerifier(num_workers=1)
    try:
        assert verifier.judge_many(PAIRS[:1]) == [Verdict.EQUAL]
        assert not isinstance(verifier._supervisor.proc, Forked)
    finally:
        verifier.close()


def test_a_task_verifier_is_never_forked(own_zygote):
    # it imports the user's module, from the trainer's directory and path: the zygote has neither
    assert verify_zygote.fork_supervisor(1, 8, "digits_verifier:Digits") is None
    forked = verify_zygote.fork_supervisor(1, 8, "math")  # while the default one is
    assert isinstance(forked, Forked)
    forked.stdin.close()  # the end of its input: it ends
    assert ended(forked)
