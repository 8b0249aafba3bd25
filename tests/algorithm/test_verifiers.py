"""reward.verifier: the built-in task verifiers, a user's verifier in the grading workers (what it raises, what
runs past its deadline, a key that disagrees with equal) and the one-line refusals of what cannot be used."""

import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trapo.algorithm.rewards import Tally, Verdict, answer_rewards, majority_votes
from trapo.algorithm.rewards.unlabeled import UnlabeledReward
from trapo.algorithm.rewards.verifiers import (
    ExactMatch,
    OptionLetters,
    check_verifier,
    extract_answers,
    load_verifier,
    require_verifier,
)
from trapo.config import ConfigError, load_config
from trapo.data import Question
from trapo.engine.grading.verifier import MathVerifier
from trapo.training.grading import grade

ROOT = Path(__file__).resolve().parents[2]
TOY_CONFIG = str(ROOT / "configs" / "toy.yaml")
# A user's verifier module, written outside the repository. The answer is what follows the last "ans:".
# equal: case-insensitive, except "BOOM" raises and "SLEEP" sleeps past any deadline; extract raises on "!!";
# key: the answer cut to its first letter, which says "same" for answers equal says differ (ab, ax).
USER_MODULE = textwrap.dedent(
    """
    import os
    import time

    def _log(what):
        path = os.environ.get("VERIFIER_CALLS")
        if path:
            with open(path, "a") as f:
                f.write(what + "\\n")

    class Letters:
        def extract(self, response):
            if "!!" in response:
                raise RuntimeError("cannot read this")
            return response.rpartition("ans:")[2].strip() or None if "ans:" in response else None

        def equal(self, answer, gold):
            _log(f"{answer}|{gold}")
            if answer == "BOOM":
                raise ValueError("boom")
            if answer == "SLEEP":
                time.sleep(60)
            return answer.lower() == gold.lower()

    class FirstLetter(Letters):
        def key(self, answer):
            return answer[0].lower()

    class BadTypes(Letters):
        def extract(self, response):
            return 5 if "5" in response else response

        def key(self, answer):
            return [answer]  # not hashable

    class NoEqual:
        def extract(self, response):
            return response

    not_a_verifier = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_verifiers.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the grading workers import it too
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("VERIFIER_CALLS", str(calls))
    return calls


def test_builtin_mcq_and_exact():
    mcq = OptionLetters()
    assert [mcq.extract(r) for r in ("so \\boxed{(b)}", "\\boxed{\\text{C}}", "\\boxed{12}", "none")] == [
        "B",
        "C",
        None,
        None,
    ]
    assert mcq.equal("b", "B") and not mcq.equal("12", "B") and mcq.key("(c)") == "C"
    exact = ExactMatch()
    assert exact.extract("\\boxed{ab c.}") == "ab c." and exact.equal("ab c.", "ab c") and not exact.equal("Ab", "ab")
    assert exact.key("$x$") == exact.key("x")


def test_what_cannot_be_used_is_one_line_naming_what_is_missing(user_module):
    assert check_verifier("math") is None and check_verifier("mcq") is None
    assert check_verifier("user_verifiers:Letters") is None
    assert "no module named 'nosuchmodule'" in check_verifier("nosuchmodule:thing")
    assert "PYTHONPATH" in check_verifier("nosuchmodule:thing")
    assert check_verifier("user_verifiers:thing") == "module 'user_verifiers' has no 'thing'"
    assert "has no equal method" in check_verifier("user_verifiers:NoEqual")
    assert "has no extract or equal method" in check_verifier("user_verifiers:not_a_verifier")
    with pytest.raises(ConfigError, match=r"^config: key 'reward.verifier': no module named 'nosuchmodule'"):
        require_verifier("nosuchmodule:thing")
    # the form is checked on loading, before anything is imported
    with pytest.raises(ConfigError, match="reward.verifier.*must be math, mcq, exact or 'module:name'"):
        load_config(TOY_CONFIG, ["reward.verifier=mathverify"])
    assert (
        load_config(TOY_CONFIG, ["reward.verifier=user_verifiers:Letters"]).reward.verifier == "user_verifiers:Letters"
    )


def test_a_verifier_that_raises_is_wrong_counted_and_warned(user_module, caplog):
    v = MathVerifier(num_workers=1, timeout=2.0, spec="user_verifiers:Letters")
    try:
        tally = Tally()
        texts = ["ans: ab", "ans: AB", "no answer", "ans: BOOM", "!! ans: ab"]
        with caplog.at_level(logging.WARNING):
            answers, keys = extract_answers(texts, v, None, None, tally)
            assert answers == ["ab", "AB", None, "BOOM", None] and keys == ["ab", "AB", None, "BOOM", None]
            assert tally == Tally(failed=1)  # extract raised on the last one
            rewards = answer_rewards(answers, ["ab"] * 5, v, 2.0, None, tally)
        assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0] and tally == Tally(failed=2)  # equal raised on BOOM
        assert v.errors == 2
        warned = [r.getMessage() for r in caplog.records if "raised" in r.getMessage()]
        assert len(warned) == 2 and "reward.verifier user_verifiers:Letters: 1 call(s) raised" in warned[0]
    finally:
        v.close()


def test_a_verifier_that_sleeps_past_its_deadline_is_wrong_and_remembered(user_module):
    v = MathVerifier(num_workers=1, timeout=0.5, spec="user_verifiers:Letters")
    try:
        v.start()
        tally = Tally()
        started = time.monotonic()
        assert answer_rewards(["SLEEP", "ab"], ["ab", "ab"], v, 0.5, None, tally) == [0.0, 1.0]
        assert tally.timeouts == 1 and time.monotonic() - started < 5
        assert v.memory()["pairs"] == [["ab", "SLEEP", 0.5]]
        started = time.monotonic()  # remembered: the vote's same comparison is answered at once
        votes = majority_votes([["ab", "SLEEP", "ab", "AB"]], v, 0.5, None, tally, [["a", "S", "a", "a"]])
        assert time.monotonic() - started < 0.5 and tally.timeouts == 2
        assert votes == [("ab", [True, False, True, True])]  # grouped by key: equal is never asked inside a key
        # a budget already spent: cut, not waited on
        assert v.judge_many([("x", "y")], 0.5, deadline=time.monotonic()) == [Verdict.CUT]
    finally:
        v.close()


def test_the_key_wins_over_equal_and_each_distinct_pair_is_compared_once(user_module):
    v = MathVerifier(num_workers=1, timeout=5.0, spec="user_verifiers:FirstLetter")
    try:
        texts = ["ans: ab", "ans: ax", "ans: AB", "ans: b", "ans: B", "ans: c", "ans: ab", "none"]
        answers, keys = extract_answers(texts, v)
        assert keys == ["a", "a", "a", "b", "b", "c", "a", None]
        user_module.write_text("")
        ((label, agree),) = majority_votes([answers], v, 5.0, None, None, [keys])
        # key a (ab, ax, AB, ab): one answer although equal("ax", "ab") is False -- the key wins; its label is
        # its first spelling; b and B (key b) and c are compared with it once each, and c with b once
        assert label == "ab" and agree == [True, True, True, False, False, False, True, False]
        calls = user_module.read_text().split()
        assert sorted(calls) == sorted(["b|ab", "c|ab", "c|b"])
        # without a key every distinct string is its own answer and equal merges them: ab, AB (equal), ax
        plain = MathVerifier(num_workers=1, timeout=5.0, spec="user_verifiers:Letters")
        try:
            answers, keys = extract_answers(["ans: ax", "ans: ab", "ans: AB", "ans: ax", "ans: ax"], plain)
            ((label, agree),) = majority_votes([answers], plain, 5.0, None, None, [keys])
            assert (label, agree) == ("ax", [True, False, False, True, True])
            answers, keys = extract_answers(["ans: ax", "ans: ab", "ans: AB", "ans: ax"], plain)
            assert majority_votes([answers], plain, 5.0, None, None, [keys]) == [(None, [False] * 4)]  # 2 vs 2
        finally:
            plain.close()
    finally:
        v.close()


def test_builtins_grade_in_the_workers():
    v = MathVerifier(num_workers=1, timeout=5.0, spec="mcq")
    try:
        answers, keys = extract_answers(["\\boxed{b}", "\\boxed{(B)}", "\\boxed{7}", "The final answer is C"], v)
        assert answers == ["B", "B", None, None] and keys == ["B", "B", None, None]
        assert answer_rewards(answers, ["B"] * 4, v, 5.0) == [1.0, 1.0, 0.0, 0.0]
    finally:
        v.close()


def test_training_refuses_a_missing_verifier_in_one_line_before_the_model_loads(tmp_path):
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "trapo_train.py", "reward.verifier=nosuchmodule:thing", f"output_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "reward.verifier" in lines[0] and "nosuchmodule" in lines[0] and "Traceback" not in out.stderr
    assert time.monotonic() - started < 60 and list(tmp_path.iterdir()) == []  # no run directory claimed


def test_load_verifier_instantiates_a_class_and_takes_an_object(user_module):
    assert type(load_verifier("user_verifiers:Letters")).__name__ == "Letters"
    assert isinstance(load_verifier("exact"), ExactMatch)


def test_an_extraction_of_the_wrong_type_or_an_unhashable_key_is_no_answer_and_counted(user_module):
    v = MathVerifier(num_workers=1, timeout=2.0, spec="user_verifiers:BadTypes")
    try:
        tally = Tally()
        assert extract_answers(["5", "ab"], v, None, None, tally) == ([None, None], [None, None])
        assert tally == Tally(failed=2) and v.errors == 2
    finally:
        v.close()


def test_the_label_efficient_rewards_cluster_by_the_verifiers_key(user_module):
    """EMPO's and SCRL's rewards on a task verifier: a cluster is a key (FirstLetter: a x4, b x2, c x1, one
    response without an answer), whatever `equal` says."""
    v = MathVerifier(num_workers=1, timeout=5.0, spec="user_verifiers:FirstLetter")
    try:
        texts = [["ans: ab", "ans: ax", "ans: AB", "ans: b", "ans: B", "ans: c", "ans: ab", "none"]]
        question = [Question("q", "?", None, False, None, "row 1")]
        empo = grade(question, texts, 5.0, v, unlabeled=UnlabeledReward("cluster_share"))
        assert empo.rewards == [[0.5, 0.5, 0.5, 0.25, 0.25, 0.125, 0.5, 0.0]]
        # SCRL: a's 4/8 beats b's 2/8 by 0.25: positive; c (1/8, entropy 0.9 >= the mean 0.2) negative
        entropy = [0.1] * 5 + [0.9, 0.1, 0.1]
        scrl = grade(question, texts, 5.0, v, unlabeled=UnlabeledReward("scrl"), scores={0: [-h for h in entropy]})
        assert scrl.rewards == [[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, 1.0, -1.0]]
    finally:
        v.close()
