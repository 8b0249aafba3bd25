"""Degenerate answers: timeouts told apart, votes that cannot stall, the grading budget.

The judge is the real one (Math-Verify in the grading processes); what a machine's speed decides (how close
a vote comes to one timeout, how it compares with grading one by one) is measured in bench/bench_vote.py.
"""

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow.parquet as pq
import pytest

from trapo.algorithm.rewards import Tally, Verdict, decide_pairs, majority_vote, majority_votes, math_rewards
from trapo.algorithm.rewards.answers import MAX_ANSWER_CHARS, normalize
from trapo.engine.grading.verifier import MathVerifier, default_verifier

judge = default_verifier()


def _golds(benchmarks_dir, name, source=None):
    rows = pq.read_table(os.path.join(benchmarks_dir, name), columns=["data_source", "reward_model"]).to_pylist()
    return [r["reward_model"]["ground_truth"] for r in rows if source is None or r["data_source"] == source]


SHORT = 1.0  # per-comparison timeout for the tests below
# Exponent towers: evaluating them (the numeric pre-filter) runs into any timeout, while being parsed.
TOWERS = [f"9^{{9^{{9^{{{k}}}}}}}" for k in range(4, 12)]
# Three spellings of 9^387420489: each parses at once, but comparing two of them runs into the timeout.
SAME_HUGE = ["9^{9^9}", "9^{387420489}", "3^{774840978}"]


class SpyVerifier(MathVerifier):
    """A real verifier that records what is sent to it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.judged: list[list[tuple[str, str]]] = []
        self.prepared: list[list[str]] = []
        self.verdicts: list[list[Verdict]] = []  # judge_many's answers, one list per request
        self.prepared_verdicts: list[list[Verdict]] = []

    def judge_many(self, pairs, timeout=None, deadline=None):
        self.judged.append(list(pairs))
        self.verdicts.append(super().judge_many(pairs, timeout, deadline))
        return self.verdicts[-1]

    def prepare_many(self, groups, timeout=None, deadline=None):
        self.prepared.append([a for g in groups for a in g])
        verdicts, values = super().prepare_many(groups, timeout, deadline)
        self.prepared_verdicts.append([v for g in verdicts for v in g])
        return verdicts, values


@pytest.fixture
def spy():
    verifier = SpyVerifier(num_workers=2, timeout=SHORT)
    verifier.start()
    yield verifier
    verifier.close()


def test_vote_over_answers_that_each_exhaust_the_timeout_takes_about_one_timeout(spy):
    tally = Tally()
    start = time.monotonic()
    assert majority_votes([TOWERS], spy, SHORT, tally=tally) == [(None, [False] * len(TOWERS))]
    elapsed = time.monotonic() - start
    # not one timeout per comparison (28 of them, 14 s on the 2 workers); how close to one timeout a vote
    # comes is a machine's speed, measured in bench/bench_vote.py
    assert elapsed < 10 * SHORT, elapsed
    assert tally == Tally(timeouts=len(TOWERS), budget_cut=0)
    assert spy.prepared == [TOWERS] and spy.judged == []  # parsed once each, side by side; never compared
    # Among ordinary answers they are frozen singletons; the rest still cluster by equivalence.
    answers = [*TOWERS[:3], "x+1", "1+x", "1+x", TOWERS[0], "2"]
    label, agree = majority_votes([answers], spy, SHORT)[0]
    assert label == "1+x" and agree == [False] * 3 + [True] * 3 + [False] * 2


DEEP = 16  # nesting of the deep fractions below


def _nested_fraction(depth: int, seed: int) -> str:
    rng = random.Random(seed)
    inner = "x"
    for _ in range(depth):
        inner = f"\\frac{{{rng.randint(1, 9)}+{inner}}}{{{rng.randint(1, 9)}-y}}"
    return inner


def test_deep_fractions_get_their_probe_value_at_once_and_the_same_value_as_evalf_subs():
    """The pre-filter's value of a nested fraction, in linear time: evalf(subs=...) took seconds from 12 deep
    (exponential in the nesting), so a vote over such answers counted every one as a timeout."""
    import cmath

    import sympy

    from trapo.engine.grading.executor import _Checker, _probe

    checker = _Checker()
    for depth in (2, 6, 10):  # the reference path, where it still finishes in a fraction of a second
        answer = _nested_fraction(depth, depth)
        expr = checker.parse(answer)[0]
        reference = complex(expr.evalf(15, subs={x: _probe(x.name) for x in expr.free_symbols}))
        assert abs(checker.value(answer) - reference) <= 1e-12 * abs(reference), depth
    deep = [_nested_fraction(DEEP, seed) for seed in range(3)]
    for answer in deep:
        value = checker.value(answer)
        assert isinstance(value, complex) and cmath.isfinite(value)  # a number, not a pre-filter failure
    assert isinstance(checker.parse(deep[0])[0], sympy.Expr)


def test_integrals_of_polynomials_get_the_probe_value_of_their_antiderivative():
    """`\\int x` parsed to an unevaluated Integral(x, x): no probe value, so every comparison with it went
    to sympy's simplify (0.5-0.8 s each beside a deep fraction, in the vote over mixed answers)."""
    from trapo.engine.grading.executor import _Checker

    checker = _Checker()
    assert checker.value("\\int x") == checker.value("\\frac{x^2}{2}") is not None
    assert checker.value("\\int y") == checker.value("xy") is not None  # y is constant in x, as to Math-Verify
    assert checker.differ("\\int x", _nested_fraction(DEEP, 0))
    assert checker.value("\\int e^{x^2} dx") is None  # no antiderivative worked out: Math-Verify decides


def test_vote_counts_exactly_the_answers_that_cannot_be_parsed_in_time(spy):
    """Towers exhaust any timeout (counted once each, never compared); 16-deep fractions did too, in the
    probe value (about 15 s of evalf): now they are ready at once and cost no timeout."""
    deep = [_nested_fraction(DEEP, seed) for seed in range(3)]
    answers = [TOWERS[0], deep[0], deep[1], TOWERS[1], deep[0], deep[2], "x+1"]
    tally = Tally()
    # The towers wait out any timeout; the fractions' parse (a tenth of a second when quiet) must not, even on a
    # slow loaded 2-core machine behind a replaced worker's start: a timeout generous for them, not a fast one.
    assert majority_votes([answers], spy, 10.0, tally=tally) == [(deep[0], [a == deep[0] for a in answers])]
    assert tally == Tally(timeouts=2, budget_cut=0)  # the two towers: the answers that cannot be parsed at all
    sent = {a for pairs in spy.judged for pair in pairs for a in pair}
    assert TOWERS[0] not in sent and TOWERS[1] not in sent  # frozen after their one parse


def test_vote_holds_without_the_soft_alarm():
    """A computation no signal interrupts (C code) is cut by killing its executor, still side by side."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # inherited by the worker processes
    timeout = 2.0  # one after another on the 2 workers: 8 s; side by side: 2 s and the replacements' forks
    try:
        verifier = MathVerifier(num_workers=2, timeout=timeout)
        verifier.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    try:
        tally = Tally()
        start = time.monotonic()
        assert majority_votes([TOWERS], verifier, timeout, tally=tally) == [(None, [False] * len(TOWERS))]
        assert time.monotonic() - start < 2.5 * timeout + 1.0  # slack for a loaded machine
        assert tally.timeouts == len(TOWERS)
        assert majority_vote(["x+1", "1+x", "y"], judge) == ("x+1", [True, True, False])  # workers replaced
        assert verifier.equal_many([("x+1", "1+x")]) == [True]
    finally:
        verifier.close()


def test_vote_never_compares_an_answer_again_after_its_comparison_timed_out(spy):
    a, b, c = SAME_HUGE
    tally = Tally()
    assert majority_votes([[a, a, b, c, "7"]], spy, SHORT, tally=tally) == [(a, [True, True, False, False, False])]
    sent = [p for pairs in spy.judged for p in pairs]
    assert (a, b) in sent and (a, c) in sent and (b, c) not in sent  # b timed out against a: frozen
    assert tally.timeouts == 2


def test_a_huge_exact_power_is_answered_as_a_timeout_without_waiting_for_it():
    """Math-Verify subtracting a 10^21-bit integer power from an answer without a probe value computes it
    exactly: the comparison would wait out the whole timeout, each round, while that power leads the vote.
    The executor's guard gives the alarm's verdict (a timeout, counted; the power frozen) at once."""
    huge = "91417776317066907439^{15000806360837783533}"
    answers = [huge, huge, "\\int e^{x^2}", "\\int e^{x^3}", "\\int e^{x^4}"]  # integrals with no probe value
    verifier = MathVerifier(num_workers=2, timeout=30.0)
    verifier.start()
    try:
        tally, started = Tally(), time.perf_counter()
        assert majority_votes([answers], verifier, 30.0, tally=tally) == [(huge, [True, True, False, False, False])]
        assert time.perf_counter() - started < 30.0  # the comparison did not wait out its timeout
        assert tally.timeouts == 1  # the power is frozen after its first comparison that timed out
        # The guard answers every comparison with the power at once, not only the vote's first one.
        assert verifier.judge_many([(huge, a) for a in answers[3:]], 30.0) == [Verdict.TIMEOUT] * 2
    finally:
        verifier.close()


def test_a_huge_factorial_is_answered_as_a_timeout_without_waiting_for_it():
    """sympy works out n! exactly when Math-Verify compares (10^{100})! with an answer that has no probe
    value: the comparison waited out the whole timeout. The executor's guard gives the alarm's verdict at
    once, for n!, Gamma of an integer and n!! (to Math-Verify, (n!)!) alike; small ones are untouched."""
    verifier = MathVerifier(num_workers=2, timeout=60.0)
    verifier.start()
    try:
        started = time.perf_counter()
        slow = [("\\alpha+\\beta", "(10^{100})!"), ("\\Gamma(10^{30})", "\\alpha\\beta"), ("\\frac12", "(2^{64})!!")]
        assert verifier.judge_many(slow, 60.0) == [Verdict.TIMEOUT] * 3
        assert time.perf_counter() - started < 60.0  # not one waited out its timeout
        small = [("5!", "120"), ("\\Gamma(6)", "120"), ("6!!", "720!"), ("(10^{3})!", "1000!")]
        assert verifier.judge_many(small, 60.0) == [Verdict.EQUAL] * 4
    finally:
        verifier.close()


def test_a_heavy_representative_is_frozen_not_the_majority_behind_it(spy):
    """A heavy answer repeated leads the vote; the majority's spellings (integrals without a probe value)
    each time out against it. Blaming the newcomer froze every spelling alone and made the heavy answer the
    label; the timeout is blamed on the answer whose value is past float range, which is frozen instead."""
    heavy = "(10^{100})!"
    spellings = ["\\int e^{x^2}", "\\int e^{x^2} dx", "\\int e^{x^{2}}\\,dx"]
    tally = Tally()
    assert majority_votes([[heavy, heavy, *spellings]], spy, 5.0, tally=tally) == [
        (spellings[0], [False, False, True, True, True])
    ]
    # one spelling tries the heavy answer first (its value cannot settle the pair): that times out and
    # freezes it; then the spellings among themselves
    assert tally.timeouts == 1
    assert spy.judged == [[(heavy, spellings[0])], [(spellings[0], s) for s in spellings[1:]]]


def _degenerate_mix(seed: int) -> list[str]:
    """64 answers of the kinds a collapsed policy gives: code-injection strings; heavy ones (exponent towers,
    factorials and Gamma of huge numbers, 100,000-character digit strings, 5,000-deep braces, a 60x60
    matrix); broken LaTeX and odd unicode; fuzz strings of LaTeX tokens; shuffled, with three spellings of
    3/7 (one pair of them needs Math-Verify) so that the vote has a winner to find among them."""
    rng = random.Random(seed)
    digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))  # noqa: E731
    injection = ["__import__('os').system('ls')", "exec('1')", "1; DROP TABLE t", "${7*7}", "\\include{/etc/hosts}"]
    injection += ["\\write18{ls}"]
    k = rng.randint(5, 9)
    heavy = [f"{k}^{{{k}^{{{k}^{{{k}}}}}}}", "4^{4^{4^{4^{4}}}}", f"(10^{{{rng.randint(20, 90)}}})!"]
    heavy += [f"{rng.randint(10**8, 10**9)}!", f"\\Gamma(10^{{{rng.randint(20, 40)}}})"]
    heavy += [f"(2^{{{rng.randint(40, 90)}}})!!", f"((10^{{{rng.randint(6, 7)}}})!)!", "2^{3^{4^{5^{6}}}}"]
    heavy += [f"{digits(20)}^{{{digits(20)}}}"]
    heavy += [digits(100_000), "9" * 100_000, "{" * 5000 + "0" + "}" * 5000, "(" * 3000 + "1" + ")" * 3000]
    matrix = "\\\\".join("&".join(digits(1) for _ in range(60)) for _ in range(60))
    heavy += ["\\begin{pmatrix}" + matrix + "\\end{pmatrix}"]
    heavy += ["\\frac{1}{" * 40 + "2" + "}" * 40, f"(10^{{{rng.randint(10, 15)}}})!", "\\Gamma(2^{80})", "10^{10^{10}}"]
    broken = ["\\frac{", "\\sqrt{", "{}{", "y_{", "\\left[", "\\frac{}{\\frac{}{}}", "\\end{matrix}", "∅", "∛8"]
    broken += ["¾", "𝔸", "\u200d", "\u2066x", "⑩", "４５", "🤖", "a³", "∏_{k}", "γ-δ", "ℶ_1", "////", "___", "^_^"]
    broken += ["\\begin{cases}", "\\]", ",,1", "\\sqrt2}", "}}}"]
    tokens = ["\\left(", "\\right)", "\\sqrt[", "]{", "}", "\\int", "_{", "^{", "\\sum", "x", "\\cdot"]
    tokens += ["\\frac{", "\\\\", "&", "\\infty", "!", "\\binom{", "\\prod", "e", "\\pi", "\\lim"]
    fuzz = [" ".join(rng.choice(tokens) for _ in range(rng.randint(10, 60))) for _ in range(9)]
    answers = injection + heavy + broken + fuzz
    assert (len(injection), len(heavy), len(broken), len(answers)) == (6, 18, 28, 61)
    rng.shuffle(answers)
    return ["\\frac{3}{7}", "0.428571428571", *answers, "\\dfrac{3}{7}"]


@pytest.fixture(params=["quiet", "loaded"])
def machine(request):
    """The machine the vote runs on: as it is, or with every core kept busy by another process."""
    if request.param == "quiet":
        yield request.param
        return
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield request.param
    finally:
        for p in burners:
            p.kill()
            p.wait()


def test_a_vote_over_degenerate_answers_pays_each_slow_answer_about_once(spy, machine):
    """Heavy answers that parse in time can still make comparisons run out of it ((10^{100})! against
    `α+β`): blamed on the newcomer, each round waited out such a comparison again. The vote finds the one
    real cluster, counts at most 15 timeouts on 64 answers, and never sends an answer again after a
    comparison of it timed out unless the other side was the one frozen."""
    answers = _degenerate_mix(seed=7)
    three = ("\\frac{3}{7}", "0.428571428571", "\\dfrac{3}{7}")
    tally = Tally()
    # 4 s: ordinary answers must not time out on a loaded 2-core machine; the heavy ones do at any timeout
    assert majority_votes([answers], spy, 4.0, tally=tally) == [(three[0], [a in three for a in answers])]
    assert 0 < tally.timeouts <= 15 and tally.budget_cut == tally.failed == 0
    frozen = {a for a, v in zip(spy.prepared[0], spy.prepared_verdicts[0]) if v.timed_out}
    later = [{a for pair in pairs for a in pair} for pairs in spy.judged]
    for r, (pairs, verdicts) in enumerate(zip(spy.judged, spy.verdicts)):
        assert frozen.isdisjoint(later[r])  # an answer that could not be parsed in time is never compared
        for pair, v in zip(pairs, verdicts):
            if v.timed_out:  # one side of a pair that timed out is never sent again
                assert any(all(a not in sent for sent in later[r + 1 :]) for a in pair), pair
    assert ("\\frac{3}{7}", "0.428571428571") in spy.judged[0]  # the one pair of the winner Math-Verify decides


def test_a_vote_settles_pairs_whose_probe_values_differ_without_sending_them(spy):
    """The parse ahead brings each answer's probe value back: pairs whose values differ are not equal, as
    the executor would say; only a pair whose values agree goes to Math-Verify."""
    one = "\\frac{1}{x+1}"
    same = "\\frac{x+1}{x+1}\\cdot\\frac{1}{x+1}"  # 1/(x+1) too, spelled otherwise
    answers = [one] * 3 + ["\\frac{2}{x+1}"] * 2 + ["x^2+1", same]
    assert majority_votes([answers], spy, SHORT) == [(one, [True] * 3 + [False] * 3 + [True])]
    assert [p for pairs in spy.judged for p in pairs] == [(one, same)]
    spy.judged.clear()
    big = ["9^{9^5}", "8^{9^5}", "7^{9^5}"]  # beyond float range: their values cross the wire as mpmath numbers
    assert majority_votes([[big[0]] * 2 + big[1:] + ["7"]], spy, SHORT) == [(big[0], [True, True, False, False, False])]
    assert not any(spy.judged)  # every pair settled by its values, none sent


def test_identical_answers_cost_no_comparisons(spy):
    assert majority_votes([["x+1"] * 8, ["\\sqrt{2}"] * 5 + [None] * 3], spy, SHORT) == [
        ("x+1", [True] * 8),
        ("\\sqrt{2}", [True] * 5 + [False] * 3),
    ]
    assert spy.judged == [] and spy.prepared == []
    assert majority_votes([["x+1"] * 4 + ["1+x"] * 3 + ["x + 1"]], spy, SHORT)[0][0] == "x+1"
    assert spy.prepared == [["x+1", "1+x"]]  # each distinct string parsed once
    assert [p for pairs in spy.judged for p in pairs] == [("x+1", "1+x")]


def test_votes_unchanged_on_ordinary_answers(benchmarks_dir, spy):
    """Same clustering as comparing each new answer with every cluster, one comparison at a time."""

    def reference(answers):
        keys = [normalize(a) if a is not None and a.strip() and len(a) <= MAX_ANSWER_CHARS else None for a in answers]
        counts = Counter(k for k in keys if k is not None)
        order = sorted(counts, key=lambda k: (-counts[k], keys.index(k)))
        raw = {k: answers[keys.index(k)] for k in order}
        clusters = []
        for key in order:
            home = next((c for c in clusters if decide_pairs([(raw[c[0]], raw[key])], spy)[0]), None)
            if home is None:
                clusters.append([key])
            else:
                home.append(key)
        sizes = [sum(counts[k] for k in c) for c in clusters]
        if not sizes or sizes.count(max(sizes)) > 1:
            return None, [False] * len(answers)
        winner = clusters[sizes.index(max(sizes))]
        return raw[winner[0]], [k in winner for k in keys]

    golds = sorted(set(_golds(benchmarks_dir, "math.parquet", "math")))
    rng = random.Random(1)
    groups = []
    for _ in range(24):
        gold, w1, w2 = rng.sample(golds, 3)
        spellings = [gold, gold.replace("\\frac", "\\dfrac"), gold + " ", w1, w2, None]
        groups.append([rng.choice(spellings) for _ in range(8)])
    tally = Tally()
    assert majority_votes(groups, spy, tally=tally) == [reference(g) for g in groups]
    assert tally == Tally()


def test_budget_cuts_comparisons_and_counts_them(spy):
    tally = Tally()
    start = time.monotonic()
    deadline = start + 0.3
    rewards = math_rewards([f"\\boxed{{{t}}}" for t in TOWERS], ["\\frac{1}{2}"] * 8, spy, 30.0, deadline, tally)
    votes = majority_votes([TOWERS], spy, 30.0, deadline, tally)
    assert time.monotonic() - start < 10  # cut at the deadline, not after the 30 s timeout (a loaded machine: slack)
    assert rewards == [0.0] * 8 and votes == [(None, [False] * 8)]
    assert tally == Tally(timeouts=0, budget_cut=8 + 28)  # every comparison cut: 8 rewards, 1+2+..+7 in the vote
    assert spy.judge_many([("x", "y")], 30.0, deadline) == [Verdict.CUT]
    # Fast paths still decide after the deadline; the rest is cut without a round trip.
    assert decide_pairs([("12", "12.0"), ("x+1", "1+x")], judge, deadline=deadline, tally=tally) == [True, False]
    assert tally.budget_cut == 8 + 28 + 1
