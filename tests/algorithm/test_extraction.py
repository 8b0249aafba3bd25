"""What counts as the answer of a response: Math-Verify's reading of the whole text
(see trapo/algorithm/rewards/extraction.py).

The reference throughout is Math-Verify itself, as the paper's reward calls it:
verify(parse("\\boxed{" + gold + "}"), parse(response)).
"""

import logging
import random
import time

import pytest
from forking import graders
from math_verify import parse, verify

from trapo.algorithm.rewards import extract_answer, majority_votes, math_rewards
from trapo.algorithm.rewards.answers import PART_JOIN, fast_equal, normalize
from trapo.data import Question
from trapo.engine.grading.executor import _Checker
from trapo.engine.grading.verifier import MathVerifier, default_verifier
from trapo.training.grading import grade

logging.getLogger("math_verify").setLevel(logging.ERROR)
judge = default_verifier()  # the rewards' judge: Math-Verify in worker processes (trapo/engine/grading/)


def math_verify_reward(response: str, gold: str) -> float:
    return 1.0 if verify(parse("\\boxed{" + gold + "}"), parse(response)) else 0.0


# (response, gold): answers as Math-Verify reads them from the whole response
WHOLE_RESPONSES = [
    # several boxes: tuples, sets, equations, `and` between boxes
    ("So the pairs are \\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}.", "(2, 2), (6, 2)"),
    ("So the pairs are \\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}.", "(2, 2)"),
    ("\\boxed{1},\\boxed{2},\\boxed{3}", "\\{1,2,3\\}"),
    ("\\boxed{1} and \\boxed{2} and \\boxed{3}", "\\{1,2,3\\}"),
    ("\\boxed{1} and \\boxed{2} and \\boxed{3}", "\\{1,2\\}"),
    ("Hence \\boxed{k = 45} \\text{ and } \\boxed{n = 2}.", "k=45, n=2"),
    ("The roots are \\boxed{-2} and \\boxed{1}.", "1, -2"),
    ("We found \\boxed{3} earlier. " + "Many more words follow here, " * 4 + "so \\boxed{4}.", "4"),
    ("We found \\boxed{3} earlier. " + "Many more words follow here, " * 4 + "so \\boxed{4}.", "3, 4"),
    # a final-answer sentence after intermediate boxes
    ("First \\boxed{255}, then $10,200 + 255 = 10,455$. The final answer is $10,455$.", "10455"),
    ("First \\boxed{255}, then $10,200 + 255 = 10,455$. The final answer is $10,455$.", "255"),
    ("Step one gives \\boxed{12}.\nFinal Answer: The final answer is 7.78. I hope it is correct.", "7.78"),
    ("\\boxed{5} is what we had. Final Answer: The largest $n$ is 34.", "34"),
    ("The final answer is $28\\%$. I hope it is correct. Earlier: \\boxed{27}", "28\\%"),
    # boxes inside $$...$$, \[...\], and environments joined by `and`
    ("$$\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}$$", "(2, 2), (6, 2)"),
    ("$$\\boxed{(3, 3)} \\text{ for part (a) and, after a long aside, for part (b) } \\boxed{(1, 1)}$$", "(3,3),(1,1)"),
    ("$$\\boxed{1} \\text{ and, after an aside much longer than seventy characters, also } \\boxed{2}$$", "1, 2"),
    ("\\boxed{1} \\text{ and, after an aside much longer than seventy characters, also } \\boxed{2}", "2"),
    ("\\boxed{1} \\text{ and, after an aside much longer than seventy characters, also } \\boxed{2}", "1, 2"),
    ("solutions are:\n\\[\n\\boxed{(1, 2)}, \\boxed{(2, 1)}\n\\]", "(2,1),(1,2)"),
    ("$\\boxed{10,455}$ and $\\boxed{7}$", "10455, 7"),
    ("$\\boxed{10,455}$ and $\\boxed{7}$", "10, 455, 7"),
    ("\\(y_1 = \\boxed{x + 1}\\) and \\(y_2 = \\boxed{x - 1}\\)", "x+1, x-1"),
    # one box still reads as it always did
    ("Thus $x = \\boxed{\\frac{1}{2}}$.", "0.5"),
    ("Thus $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{3}"),
]


@pytest.mark.parametrize("response,gold", WHOLE_RESPONSES, ids=range(len(WHOLE_RESPONSES)))
def test_reward_is_math_verify_on_the_whole_response(response, gold):
    assert math_reward_of(response, gold) == math_verify_reward(response, gold)


def math_reward_of(response, gold):
    return math_rewards([response], [gold], judge)[0]


def test_whole_response_cases_hold_both_verdicts():
    verdicts = [math_verify_reward(r, g) for r, g in WHOLE_RESPONSES]
    assert sum(verdicts) >= 15 and len(verdicts) - sum(verdicts) >= 6


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{1},\\boxed{2}", "1,2"),
        ("\\boxed{1} \\boxed{1} \\boxed{2}", "1,2"),  # repeats in a row count once
        ("\\boxed{3}. " + "x " * 40 + "\\boxed{4}", "4"),  # too far apart: the last one
        ("\\boxed{12} ... The final answer is $10,455$.", "10,455"),
        ("The final answer is 2^10 ways.", "{2}^{10}"),  # a plain expression, read as Python reads `^`
        ("The final answer is 1,2345. I hope it is correct.", "1.2345"),  # what lets "I hope" follow
        ("$\\boxed{1}$ and $\\boxed{2}$", "1" + PART_JOIN + "2"),  # parts the workers parse one by one
        ("$$\\boxed{a} \\text{ then a long aside of more than seventy characters here } \\boxed{b}$$", "a,b"),
        ("the answer is 12", None),  # neither a box nor a stated final answer
        ("so \\boxed{5}. then \\boxed{\\frac{1}{3}", None),  # a box left open (cut off) is no answer
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$ done", "5"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def _fragment(rng: random.Random) -> str:
    values = ["5", "-3", "\\frac{1}{2}", "(2, 2)", "x = 1", "\\{1, 2\\}", "3\\sqrt{2}", "10,455", "28\\%"]
    values.append("\\text{Yes}")
    plain = ["5", "10,455", "-3", "3/4", "2^10", "7.78", "28 percent", "$12", "5 + 3"]
    joins = [" and ", ", ", " \\quad \\text{and} \\quad ", " or ", "; ", " ", "\n", " then, after many more words, "]
    envs = [("$", "$"), ("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)")]

    def box():
        return "\\boxed{" + rng.choice(values) + "}"

    def env(body):
        opener, closer = rng.choice(envs)
        return f"{opener} {body} {closer}"

    kind = rng.randrange(6)
    if kind == 0:
        return box()
    if kind == 1:
        return box() + rng.choice(joins) + box()
    if kind == 2:
        first, second = (rng.choice([box(), rng.choice(values)]) for _ in range(2))
        return env(first + rng.choice(joins) + second)
    if kind == 3:
        lead = rng.choice(["The final answer is ", "Final Answer: The final answer is ", "The final answer, then, is "])
        value = rng.choice(["$" + rng.choice(values) + "$", rng.choice(plain), env(rng.choice(values))])
        return lead + value + rng.choice([".", ". I hope it is correct.", "", " and $" + rng.choice(values) + "$"])
    return rng.choice(["So", "we get", "Thus", "which gives", "\n\n", "hence", "Therefore,"])


def test_answers_read_as_math_verify_reads_the_whole_response():
    """Random compositions of boxes, environments and final-answer sentences: our answer string, parsed as
    the workers parse it, is what Math-Verify's parse makes of the whole response."""
    rng = random.Random(0)
    checker = _Checker()
    compared = 0
    for _ in range(200):
        response = " ".join(_fragment(rng) for _ in range(rng.randint(1, 6)))
        ours = extract_answer(response)
        reference = parse(response)
        if ours is None:
            assert "\\boxed" not in response and "inal answer" not in response, response
            continue
        mine = checker.parse(ours)
        same = str(mine[0]) == str(reference[0]) or (verify(reference, mine) and verify(mine, reference))
        assert same, (response, ours, mine, reference)
        compared += 1
    assert compared >= 150


def test_several_boxes_vote_with_one_set():
    assert majority_votes([["1,2", "\\{1, 2\\}", "3"]], judge)[0] == ("1,2", [True, True, False])
    question = Question("f:1", "x", None, False, None, "f row 1")
    texts = [["so \\boxed{1},\\boxed{2}", "thus \\boxed{\\{1, 2\\}}", "$\\boxed{2}$ and $\\boxed{1}$", "\\boxed{3}"]]
    g = grade([question], texts, timeout=5.0)
    assert g.rewards == [[1.0, 1.0, 1.0, 0.0]]


# --- the fast paths' two defects, and verdicts that must not change between runs

MATRIX_PAIRS = [
    ("\\begin{pmatrix}-3\\\\6\\end{pmatrix}", "3\\begin{pmatrix}-1\\\\2\\end{pmatrix}"),
    ("\\begin{pmatrix}2\\\\4\\end{pmatrix}", "+".join(["\\begin{pmatrix}1\\\\2\\end{pmatrix}"] * 2)),
    ("\\begin{pmatrix}2&0\\\\0&2\\end{pmatrix}", "2\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}"),
    ("\\begin{pmatrix}-3\\\\7\\end{pmatrix}", "3\\begin{pmatrix}-1\\\\2\\end{pmatrix}"),
]


def test_matrices_fall_through_to_math_verify():
    checker = _Checker()
    assert checker.value(MATRIX_PAIRS[0][1]) is None  # evalf recursed to the limit: no value, not "not equal"
    ours = math_rewards([f"so \\boxed{{{p}}}" for _, p in MATRIX_PAIRS], [g for g, _ in MATRIX_PAIRS], judge)
    assert ours == [math_verify_reward(f"\\boxed{{{p}}}", g) for g, p in MATRIX_PAIRS] == [1.0, 1.0, 1.0, 0.0]
    votes = majority_votes([[MATRIX_PAIRS[0][1], MATRIX_PAIRS[0][0], "\\begin{pmatrix}1\\\\1\\end{pmatrix}"]], judge)
    assert votes == [(MATRIX_PAIRS[0][1], [True, True, False])]  # one answer, not two split votes


SPACED = [("23", "2 \\quad 3"), ("12", "1 \\qquad 2"), ("15", "1  5"), ("15", "1\n5")]
SPACED += [("1000", "1\\!000"), ("6", "1  5")]


def test_spaced_digits_are_not_one_number():
    ours = math_rewards([f"\\boxed{{{p}}}" for _, p in SPACED], [g for g, _ in SPACED], judge)
    assert ours == [math_verify_reward(f"\\boxed{{{p}}}", g) for g, p in SPACED] == [0, 0, 0, 0, 1, 1]
    assert normalize("2 \\quad 3") == normalize("2  3") == "2 3" and normalize("x + 1") == "x+1"
    assert fast_equal("1 5", "1 \\quad 5") is True and fast_equal("15", "1  5") is None


DEGENERATE = [
    ("0", "4 0/0"),
    ("4 0/0", "0"),
    ("\\infty", "4 0/0"),
    ("0", "0/0"),
    ("1", "1/0"),
    ("0", "0 \\cdot \\infty"),
]


def test_verdicts_on_degenerate_answers_do_not_change_between_runs(monkeypatch):
    # Math-Verify's verdicts on these follow set order (the hash seed) and the order in which sympy's
    # assumptions try their rules (its own random generator): `0` vs `4 0/0` is equal in about half of
    # fresh processes. Two fresh verifiers, with different items before, in another order, must agree.
    monkeypatch.delenv(graders.ENV, raising=False)  # started supervisors, each its own interpreter
    verdicts = []
    for before, pairs in (([], DEGENERATE), ([("x^2", "\\frac{0}{0}"), ("1/0", "y")], DEGENERATE[::-1])):
        verifier = MathVerifier(num_workers=1)
        try:
            verifier.start()
            with open(f"/proc/{verifier._supervisor.proc.pid}/environ", "rb") as f:
                assert b"PYTHONHASHSEED=0" in f.read().split(b"\0")  # executors fork from it: same seed
            verifier.judge_many(before)
            verdicts.append(dict(zip(pairs, verifier.judge_many(pairs))))
        finally:
            verifier.close()
    assert verdicts[0] == verdicts[1]


# --- bounded work on adversarial text

HUGE = [
    "$" * 200_000,
    "\\[" * 100_000 + "\\boxed{1}",
    "$\\boxed{1}" * 20_000,
    "".join(f"\\boxed{{{k}}}" for k in range(20_000)),
    "final answer is $" * 20_000,
    "The final answer is " + "1+" * 100_000 + "x",
    "\\boxed{" * 50_000 + "}",
    "\\boxed{" + "{" * 200_000 + "}",
    "x" * 1_000_000 + "\\boxed{42}",
]


@pytest.mark.parametrize("text", HUGE, ids=range(len(HUGE)))
def test_extraction_stays_bounded_on_huge_text(text):
    start = time.monotonic()
    answer = extract_answer(text)
    assert time.monotonic() - start < 3.0  # linear scans: ~0.4 s at worst on one core
    assert answer is None or isinstance(answer, str)
