import os
import random
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq
import pytest

from trapo.algorithm.rewards import (
    Tally,
    Verdict,
    decide_pairs,
    extract_boxed,
    majority_vote,
    majority_votes,
    math_reward,
    math_rewards,
)
from trapo.algorithm.rewards.answers import MAX_ANSWER_CHARS, choice_letter, exact_number, fast_equal, normalize
from trapo.engine.grading.verifier import MathVerifier, default_verifier

TIMEOUT = 2.0  # short, to keep adversarial tests quick; the default is 5 s
judge = default_verifier()  # the rewards' judge: Math-Verify in worker processes (trapo/engine/grading/)


def _golds(benchmarks_dir, name, source=None):
    rows = pq.read_table(os.path.join(benchmarks_dir, name), columns=["data_source", "reward_model"]).to_pylist()
    return [r["reward_model"]["ground_truth"] for r in rows if source is None or r["data_source"] == source]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("$\\boxed 5$ done", "5"),
        ("\\fbox{7}", "7"),
        ("no box here", None),
        ("\\boxed{}", None),
        ("\\boxed{\\frac{1}{2}", None),  # unclosed
        ("\\boxed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_exact_numbers_and_fast_equal():
    assert exact_number("\\dfrac{3}{4}") == exact_number("0.75") == exact_number("3/4")
    assert exact_number("-\\frac{1}{2}") == exact_number("-0.5")
    assert exact_number("x+1") is None
    assert fast_equal("12", "12.0") is True
    assert fast_equal("12", "13") is False
    assert fast_equal("\\frac{1}{3}", "0.3333333") is None  # within Math-Verify's rounding: its call
    assert fast_equal("x+1", "1+x") is None
    assert choice_letter("\\text{(B)}") == "B" and choice_letter("B.") == "B" and choice_letter("AB") is None


def test_math_reward_basic_cases():
    assert math_reward("The answer is \\boxed{\\frac{1}{2}}", "0.5", judge) == 1.0
    assert math_reward("\\boxed{x+1}", "1+x", judge) == 1.0  # needs Math-Verify
    assert math_reward("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", judge) == 1.0
    assert math_reward("\\boxed{13}", "12", judge) == 0.0
    assert math_reward("\\boxed{\\sqrt{3}}", "\\sqrt{2}", judge) == 0.0
    assert math_reward("the answer is 12", "12", judge) == 0.0  # no box
    assert math_reward("\\boxed{(B)}", "B", judge) == 1.0
    assert math_reward("\\boxed{C}", "B", judge) == 0.0


def test_every_math_gold_grades_against_itself(benchmarks_dir):
    golds = _golds(benchmarks_dir, "math.parquet")
    assert len(golds) == 2591
    rewards = math_rewards([f"Thus \\boxed{{{g}}}." for g in golds], golds, judge)
    bad = [g for g, r in zip(golds, rewards) if r != 1.0]
    assert not bad, bad[:5]


@pytest.mark.parametrize("name", ["arc_c.parquet", "gpqa.parquet"])
def test_choice_golds_grade_letters(benchmarks_dir, name):
    golds = _golds(benchmarks_dir, name)
    assert golds and all(len(g.strip()) == 1 for g in golds)
    assert math_rewards([f"\\boxed{{{g}}}" for g in golds], golds, judge) == [1.0] * len(golds)
    assert math_rewards([f"\\boxed{{\\text{{({g})}}}}" for g in golds], golds, judge) == [1.0] * len(golds)
    wrong = [{"A": "B"}.get(g, "A") for g in golds]
    assert math_rewards([f"\\boxed{{{w}}}" for w in wrong], golds, judge) == [0.0] * len(golds)


def test_fast_paths_agree_with_plain_math_verify(benchmarks_dir):
    """Our pipeline (fast paths + numeric pre-filter + workers) gives Math-Verify's verdicts."""
    from math_verify import parse, verify

    golds = sorted(set(_golds(benchmarks_dir, "math.parquet", "math")))
    rng = random.Random(0)
    pairs = [(rng.choice(golds), rng.choice(golds)) for _ in range(120)]
    pairs += [(g, g.replace("\\frac", "\\dfrac")) for g in rng.sample(golds, 30)]
    pairs += [(g, g + ".0") for g in golds if g.isdigit()][:20]
    # Symbolic answers: equal and unequal polynomials, variables, text, constants.
    pairs += [
        ("x^2+2x+1", "(x+1)^2"),
        ("x^2+2x+1", "(x-1)^2"),
        ("-13x+3", "350"),
        ("2k+2", "2(k+1)"),
        ("\\sin^2 x + \\cos^2 x", "1"),
        ("x^2", "y^2"),
        ("\\frac{x}{3}", "0.333333x"),
        ("\\text{Evelyn}", "\\text{evelyn}"),
        ("\\frac{1}{x}", "x^{-1}"),
        ("\\infty", "10^{10}"),
        ("\\pi r^2", "r^2\\pi"),
        # spacing between digits is no one number; a matrix the probe point cannot evaluate
        ("23", "2 \\quad 3"),
        ("15", "1  5"),
        ("\\begin{pmatrix}-3\\\\6\\end{pmatrix}", "3\\begin{pmatrix}-1\\\\2\\end{pmatrix}"),
        # integrals of polynomials get a probe value: worked out, as Math-Verify's simplify works them out
        ("\\int x", "\\frac{x^2}{2}"),
        ("\\int y", "xy"),
        ("\\int y", "\\int x"),
        ("\\int 2x dx", "x^2"),
        ("\\int x dx", "x^2"),
        ("\\int_0^1 x dx", "\\frac{1}{2}"),
        ("\\int_0^y t^2 dt", "\\frac{y^3}{3}"),
        ("\\int \\sin x dx", "-\\cos x"),
    ]
    ours = decide_pairs(pairs, judge)
    reference = [verify(parse(f"\\boxed{{{g}}}"), parse(f"\\boxed{{{p}}}")) for g, p in pairs]
    mismatches = [(p, o, r) for p, o, r in zip(pairs, ours, reference) if o != r]
    assert not mismatches
    assert sum(reference) >= 20 and len(reference) - sum(reference) >= 100  # both verdicts well represented


ADVERSARIAL = [
    "\\boxed{9^{9^{9^{9^9}}}}",
    "\\boxed{10^{10^{10^{10^{10}}}}!}",
    "\\boxed{" + "9" * 100_000 + "}",
    "\\boxed{" + "x+" * 50_000 + "1}",
    "x" * 100_000 + "\\boxed{\\frac{1}{2}",
    "\\boxed{{{{{{{{{",
    "\\boxed{}}}}}}}",
    "\\boxed{\\frac{}{}}",
    "\\boxed{ünïcödé ∑∫√ 🤖}",
    "\\boxed{\\begin{pmatrix}" + "1&" * 2000 + "\\end{pmatrix}}",
]


@pytest.mark.parametrize("response", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_answers_score_zero_within_timeout(response):
    start = time.monotonic()
    assert math_reward(response, "\\frac{\\sqrt{3}}{7}", judge, timeout=TIMEOUT) == 0.0
    assert time.monotonic() - start < TIMEOUT + 1.5  # + pipe and start-up slack of a replaced worker


def test_long_response_with_short_box_still_grades():
    assert math_reward("x" * 100_000 + "\\boxed{42}", "42", judge) == 1.0
    assert math_reward("\\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}", "1", judge) == 0.0


def test_timeout_holds_in_worker_threads_and_workers_recover():
    responses = ["\\boxed{9^{9^{9^{9^9}}}}", "\\boxed{x^2+2x+1}"]
    golds = ["\\sqrt{2}+x", "(x+1)^2"]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        got = list(pool.map(lambda rg: math_reward(rg[0], rg[1], judge, timeout=TIMEOUT), zip(responses, golds)))
    assert got == [0.0, 1.0]
    assert time.monotonic() - start < 2 * TIMEOUT + 3
    assert math_reward("\\boxed{x+1}", "1+x", judge) == 1.0  # the killed worker was replaced


def test_majority_vote_clusters_by_equivalence():
    assert majority_vote(["2", "2", "3"], judge) == ("2", [True, True, False])
    label, agree = majority_vote(["0.5", "\\frac{1}{2}", "1/2", "3", "3", None], judge)
    assert label == "0.5" and agree == [True, True, True, False, False, False]
    label, agree = majority_vote(["y", "x+1", "1+x", "x + 1"], judge)
    assert label == "x+1" and agree == [False, True, True, True]


def test_majority_vote_ties_and_empty_give_no_label():
    assert majority_vote(["1", "2"], judge) == (None, [False, False])
    assert majority_vote(["1", "1", "\\frac{4}{2}", "2"], judge) == (None, [False] * 4)
    assert majority_vote([], judge) == (None, [])
    assert majority_vote([None, None, ""], judge) == (None, [False, False, False])


def test_majority_votes_batch_matches_single_calls():
    groups = [["1", "1", "2"], ["x", "y", "y"], [None, "B", "(B)"], []]
    assert majority_votes(groups, judge) == [majority_vote(g, judge) for g in groups]


# --- degenerate answers: timeouts told apart, votes that cannot stall, the grading budget

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

    def judge_many(self, pairs, timeout=None, deadline=None):
        self.judged.append(list(pairs))
        return super().judge_many(pairs, timeout, deadline)

    def prepare_many(self, groups, timeout=None, deadline=None):
        self.prepared.append([a for g in groups for a in g])
        return super().prepare_many(groups, timeout, deadline)


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
    try:
        verifier = MathVerifier(num_workers=2, timeout=SHORT)
        verifier.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    try:
        tally = Tally()
        start = time.monotonic()
        assert majority_votes([TOWERS], verifier, SHORT, tally=tally) == [(None, [False] * len(TOWERS))]
        assert time.monotonic() - start < 1.5 * SHORT + 1.0  # + forking replacements
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
    The executor's guard gives the alarm's verdict (a timeout, counted; the new answer frozen) at once."""
    huge = "91417776317066907439^{15000806360837783533}"
    answers = [huge, huge, "\\int e^{x^2}", "\\int e^{x^3}", "\\int e^{x^4}"]  # integrals with no probe value
    verifier = MathVerifier(num_workers=2, timeout=30.0)
    verifier.start()
    try:
        tally, started = Tally(), time.perf_counter()
        assert majority_votes([answers], verifier, 30.0, tally=tally) == [(huge, [True, True, False, False, False])]
        assert time.perf_counter() - started < 30.0  # not one of the three comparisons waited out its timeout
        assert tally.timeouts == 3
    finally:
        verifier.close()


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
