"""What the rewards ask of whatever compares answers: the `Judge` they are given, and the `Verdict` it answers.

The reward functions (`verifiable`, `verifiers.extract_answers`) settle what exact checks can settle and
hand the rest to a judge passed in by the caller: the trainer's and the evaluation's is Math-Verify in
worker processes with hard deadlines (`trapo.engine.grading.verifier.MathVerifier`). A test can pass any
object with these methods.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class Verdict(enum.Enum):
    """The outcome of one comparison (or, for `prepare_many`, of parsing one answer)."""

    EQUAL = "1"
    NOT_EQUAL = "0"
    READY = "r"  # prepare_many: parsed, and cached for the comparisons to come
    TIMEOUT = "t"  # both answers parsed, but comparing them ran out of time: blame the pair
    GOLD_TIMEOUT = "g"  # parsing the gold ran out of time, now or at an earlier call
    PRED_TIMEOUT = "p"  # parsing the pred ran out of time, now or at an earlier call
    CUT = "b"  # the grading budget was spent before it was decided
    FAILED = "f"  # undecided: grading processes died on it twice, or none could be restarted
    ERROR = "e"  # a task verifier's call raised (`reward.verifier`): wrong, counted with the failed
    EXTRACTED = "x"  # extract_many: a task verifier's extraction came back (its answer and key)

    @property
    def timed_out(self) -> bool:
        return self in (Verdict.TIMEOUT, Verdict.GOLD_TIMEOUT, Verdict.PRED_TIMEOUT)


class Judge(Protocol):
    """Decides (gold, pred) answer pairs. spec: `reward.verifier`, `math` for Math-Verify; another spec's judge
    decides every pair itself (no math fast path) and reads the answers too (`extract_many`). timeout: seconds
    per item (None: the judge's own); deadline: a `time.monotonic()` value after which nothing is decided (CUT)."""

    spec: str

    def judge_many(
        self, pairs: Sequence[tuple[str, str]], timeout: float | None = None, deadline: float | None = None
    ) -> list[Verdict]:
        """A Verdict for each pair."""
        ...

    def prepare_many(
        self, groups: Sequence[Sequence[str]], timeout: float | None = None, deadline: float | None = None
    ) -> tuple[list[list[Verdict]], dict[str, object]]:
        """Each answer parsed once ahead of the comparisons within its group: per answer READY, GOLD_TIMEOUT or
        CUT, and the probe values (`answers.values_differ`) of the answers that have one."""
        ...

    def extract_many(
        self, texts: Sequence[str], timeout: float | None = None, deadline: float | None = None
    ) -> tuple[list[Verdict], list[str | None]]:
        """A task verifier's reading of each response: its verdict, and its payload (`verifiers.decode`) where
        the verdict is EXTRACTED."""
        ...
