"""Math-Verify in worker processes (trapo/engine/grading/): verdicts that tell a timeout from "not equal", the
memory of what exhausted a timeout, and the wire between the processes. How the rewards and the vote use this
judge: tests/algorithm/test_rewards.py; processes that die: test_grader_deaths.py."""

import os
import time

import pyarrow.parquet as pq
import pytest

from trapo.algorithm.rewards import Verdict
from trapo.engine.grading.protocol import decode_value, encode_value
from trapo.engine.grading.verifier import MathVerifier

SHORT = 1.0  # per-comparison timeout
TOWER = "9^{9^{9^{4}}}"  # evaluating it (the numeric pre-filter) runs into any timeout, while being parsed
# Two spellings of 9^387420489: each parses at once, but comparing them runs into the timeout.
SAME_HUGE = ["9^{9^9}", "9^{387420489}"]


@pytest.fixture
def verifier():
    v = MathVerifier(num_workers=2, timeout=SHORT)
    v.start()
    yield v
    v.close()


def test_math500_golds_verify_through_math_verify_itself(benchmarks_dir):
    # The fast path would settle identical strings; ask the workers directly.
    rows = pq.read_table(os.path.join(benchmarks_dir, "math.parquet"), columns=["data_source", "reward_model"])
    golds = sorted({r["reward_model"]["ground_truth"] for r in rows.to_pylist() if r["data_source"] == "math"})
    verifier = MathVerifier(num_workers=2)
    try:
        verdicts = verifier.equal_many([(g, g) for g in golds])
    finally:
        verifier.close()
    assert all(verdicts), [g for g, ok in zip(golds, verdicts) if not ok][:5]


def test_verdicts_tell_timeouts_from_not_equal(verifier):
    pairs = [("x^2", "y^2"), ("\\frac{1}{2}", TOWER), (SAME_HUGE[0], SAME_HUGE[1]), ("9^{9^9}", "2")]
    assert verifier.judge_many(pairs) == [Verdict.NOT_EQUAL, Verdict.PRED_TIMEOUT, Verdict.TIMEOUT, Verdict.NOT_EQUAL]
    assert verifier.equal_many(pairs) == [False] * 4
    start = time.monotonic()  # what exhausted the timeout is remembered: no second wait
    assert verifier.judge_many([(TOWER, "1")], SHORT) == [Verdict.GOLD_TIMEOUT]
    assert time.monotonic() - start < SHORT  # a second wait would be the whole timeout
    assert verifier.timeouts == 5  # counted each time, remembered or not


def test_what_exhausted_a_short_timeout_gets_a_longer_one_again(verifier):
    pair = ("x^{2^{30}}", "x^{1073741824}")  # about 0.3 s of sympy
    assert verifier.judge_many([pair], timeout=0.05)[0].timed_out
    assert verifier.judge_many([pair], timeout=30.0) == [Verdict.EQUAL]


def test_a_probe_value_crosses_the_wire_exactly():
    for value in (complex(1 / 3, -0.0), complex(-1e300, 5e-324), complex(0.6180339887, 2.0)):
        back = decode_value(encode_value(value).decode())
        assert back == value and str(back) == str(value)  # -0.0 kept
    assert encode_value(None) == b"" and decode_value("") is None
    mpmath = pytest.importorskip("mpmath")
    for big in (mpmath.mpf("1e400000"), mpmath.mpf("-2.6e354535373466"), mpmath.power(9, mpmath.power(9, 9))):
        assert decode_value(encode_value(big).decode()) == big  # beyond float range, exactly: the vote compares it
    assert encode_value(mpmath.mpc("1e400000", 1)) == b""  # a complex one: compared in the executors
