"""Task verifiers (`reward.verifier`): what the answer of a response is, and when two answers are the same.

    math            the default: `extract_answer` and Math-Verify (the fast paths of `verifiable`)
    mcq             option letters A-J, as the evaluation reads ARC-c, GPQA and MMLU-Pro
    exact           the answer `extract_answer` finds, equal when equal after `answers.normalize`
    module:name     a user's object (a class is instantiated with no arguments) with
                    extract(response) -> str | None, equal(answer, gold) -> bool and,
                    optionally, key(answer) -> Hashable (docs/tasks.md)

Every verifier but `math` runs in the grading workers (`trapo.engine.grading.verifier.MathVerifier` with
`spec`, the executors' `TaskChecker`): each call has the comparison deadline, a call that raises or runs past it
is a wrong answer (counted, warned about), a response or a pair that exhausted it is remembered.

The vote (`verifiable.majority_votes`) groups a question's answers by key first (equal keys: one
answer, `equal` never asked), then asks `equal` across groups, each distinct pair at most once. A
key that says "same" where `equal` would say "different" wins: keys are trusted, by contract.
"""

from __future__ import annotations

import base64
import importlib
import pickle
from collections.abc import Hashable, Sequence

from trapo.algorithm.rewards.answers import choice_letter, normalize
from trapo.algorithm.rewards.extraction import extract_answer
from trapo.algorithm.rewards.judge import Judge
from trapo.config.choices import verifier_problem

# Marks a response sent to the workers for extraction: the memory of slow items then never mistakes a response
# for an answer of the same spelling (`MathVerifier.extract_many` adds it, `TaskChecker.single` drops it).
EXTRACT_MARK = "⟨response⟩"


class OptionLetters:
    """`mcq`: the option letter of the extracted answer (`B`, `(b)`, `\\text{B}`); no letter, no answer."""

    def extract(self, response: str) -> str | None:
        answer = extract_answer(response)
        return None if answer is None else choice_letter(answer)

    def equal(self, answer: str, gold: str) -> bool:
        letter = choice_letter(answer)
        return letter is not None and letter == choice_letter(gold)

    def key(self, answer: str) -> Hashable:
        return choice_letter(answer) or answer


class ExactMatch:
    """`exact`: the extracted answer, equal to the gold when their `normalize`d strings are."""

    def extract(self, response: str) -> str | None:
        return extract_answer(response)

    def equal(self, answer: str, gold: str) -> bool:
        return normalize(answer) == normalize(gold)

    def key(self, answer: str) -> Hashable:
        return normalize(answer)


def load_verifier(spec: str):
    """The verifier object `spec` names (not `math`); raises VerifierError with one line on any problem."""
    if spec == "mcq":
        return OptionLetters()
    if spec == "exact":
        return ExactMatch()
    if (problem := verifier_problem(spec)) is not None or spec == "math":
        raise VerifierError(problem or "math has no verifier object (it is Math-Verify in the workers)")
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise VerifierError(
                f"no module named {err.name!r} (from {spec!r}): put the folder that holds it on PYTHONPATH"
            ) from None
        raise VerifierError(f"importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    except Exception as err:  # noqa: BLE001 - the user's module: any error is one line
        raise VerifierError(f"importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise VerifierError(f"module {module_name!r} has no {name!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as err:  # noqa: BLE001
            raise VerifierError(f"{spec}(): instantiating it failed: {type(err).__name__}: {err}") from None
    missing = [m for m in ("extract", "equal") if not callable(getattr(obj, m, None))]
    if missing:
        raise VerifierError(
            f"{spec} has no {' or '.join(missing)} method (it needs extract and equal; key is optional)"
        )
    if getattr(obj, "key", None) is not None and not callable(obj.key):
        raise VerifierError(f"{spec}: key must be a method (or absent)")
    return obj


def check_verifier(spec: str) -> str | None:
    """None when `spec` is usable; else one line saying what is missing (callers name `reward.verifier`)."""
    if spec == "math":
        return None
    try:
        load_verifier(spec)
    except VerifierError as err:
        return str(err)
    return None


def require_verifier(spec: str, where: str = "config: key 'reward.verifier'") -> None:
    """Raise ConfigError (one line: `where`, then what is missing) unless `spec` is usable: called before any
    model loads."""
    from trapo.config import ConfigError

    if (problem := check_verifier(spec)) is not None:
        raise ConfigError(f"{where}: {problem}")


class VerifierError(Exception):
    """`reward.verifier` names something that cannot be used (one line)."""


class TaskChecker:
    """A verifier object as a grading executor runs it (`trapo.engine.grading.executor`).

    `single(response)` extracts the answer and its key, sent back as one code (`x` + base64 of the pickled
    pair, read by `decode`); `prepare` has nothing to do per answer; `equal(gold, pred)` asks the
    verifier's equal(pred, gold). A call that raises is the code `e` (an error: wrong, counted)."""

    on_error = b"e\n"

    def __init__(self, verifier):
        self.verifier = verifier
        self.keyed = callable(getattr(verifier, "key", None))

    def clear(self) -> None:
        pass

    def reseed(self) -> None:
        pass

    def prepare(self, answer: str) -> None:
        pass

    def single(self, response: str) -> bytes:
        answer = self.verifier.extract(response.removeprefix(EXTRACT_MARK))
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"extract returned {type(answer).__name__}, not str or None")
        key = None if answer is None else self.verifier.key(answer) if self.keyed else answer
        hash(key)  # a key must be hashable: an error here, not in the vote
        return b"x" + base64.b64encode(pickle.dumps((answer, key)))

    def equal(self, gold: str, pred: str) -> bool:
        return bool(self.verifier.equal(pred, gold))


def decode(payload: str) -> tuple[str | None, Hashable]:
    """An extraction's (answer, key) from `TaskChecker.single`'s code (without its `x`)."""
    return pickle.loads(base64.b64decode(payload))


def extract_answers(
    texts: Sequence[str], judge: Judge | None = None, timeout: float | None = None, deadline=None, tally=None
):
    """(answers, keys): each response's answer (None without one) and its vote key.

    `math` (judge None, or Math-Verify's): `extract_answer` here, keys None (the vote normalizes).
    Otherwise the task verifier's extract and key run in the judge's workers: one that raises, times
    out, is cut or fails gives None (counted in `tally`)."""
    if judge is None or judge.spec == "math":
        return [extract_answer(t) for t in texts], None
    verdicts, payloads = judge.extract_many(list(texts), timeout, deadline)
    if tally is not None:
        tally.add(verdicts)
    answers: list[str | None] = []
    keys: list[Hashable] = []
    for payload in payloads:
        answer, key = (None, None) if payload is None else decode(payload)
        answers.append(answer)
        keys.append(key)
    return answers, keys
