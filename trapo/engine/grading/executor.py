"""The executors' side of Math-Verify grading: processes forked by the supervisor (`supervisor`).

An executor serves one item after another from its pipe (`protocol`): Math-Verify with a
parse cache and a numeric pre-filter (`_Checker`), each item under a soft alarm (SIGALRM raises
`_Overtime`), its progress marked in a byte shared with the supervisor, which kills it past the hard
deadline. It dies with the supervisor (PR_SET_PDEATHSIG).

Numeric pre-filter: each side that parses to a scalar expression is
evaluated at one fixed probe point (every single-letter variable gets its own
irrational-looking value; integrals of polynomials are worked out first).
Expressions that are equal must agree there, so
values that differ by more than 1e-4 relative prove "not equal" (Math-Verify
compares numbers after rounding to 6 decimals) and the slow symbolic path
(sympy's simplify: docs/upstream-notes.md) is skipped. Values
beyond float range (9^{9^9}) are compared as mpmath numbers, which spares
Math-Verify evaluating them exactly. Answers with text or units that change
the value on parsing (percent, degrees) are never pre-filtered; neither are
multi-letter symbols, sets, tuples, relations or matrices. The filter can
only say "not equal": where it cannot compute or compare values (any
exception, a recursion limit, a type it does not know), Math-Verify decides.
"""

from __future__ import annotations

import cmath
import ctypes
import mmap
import os
import signal

from trapo import faults
from trapo.algorithm.rewards.answers import PART_MARK, exact_number, values_differ
from trapo.engine.grading.protocol import _read_message, encode_value

_NO_FILTER = ("%", "circ", "degree", "text", "mathrm", "mbox")
# An exact rational power whose result has more bits than this runs far past any timeout and takes over 100 MB
# (the measured growth: docs/upstream-notes.md).
EXACT_POWER_BITS = 10**9
# n! past this (over 2*10^8 bits) takes sympy minutes: 10^6! 4.6 s, 3*10^6! 29 s (docs/upstream-notes.md).
EXACT_FACTORIAL_MAX = 10**7


def _probe(name: str) -> float:
    """The probe-point value of variable `name`: distinct per letter, not a round number."""
    return 0.6180339887 + 0.7071067812 * (ord(name) % 29)


class _Overtime(BaseException):
    """Raised by the soft alarm; a BaseException, so that Math-Verify's `except Exception` lets it through."""


def _ring(signum, frame):
    raise _Overtime()


def _guard_exact_powers(numbers) -> None:
    """Have sympy's exact power of a rational number (`numbers`: sympy.core.numbers) raise `_Overtime` at
    once where its result would pass EXACT_POWER_BITS. latex2sympy parsing 3^{9^{2^{11}}}, or Math-Verify
    subtracting 91417776317066907439^{15000806360837783533} from another answer, computes that integer
    exactly (sympy 1.14: `Integer._eval_power`, `Rational._eval_power`), and the soft alarm would ring only
    after the whole timeout: the verdict is the alarm's, given without the wait."""
    if getattr(numbers.Rational._eval_power, "guarded", False):
        return

    def guard(original, bits):
        def _eval_power(self, expt):
            if isinstance(expt, numbers.Rational) and bits(self) * abs(expt.p) > EXACT_POWER_BITS * expt.q:
                raise _Overtime()
            return original(self, expt)

        _eval_power.guarded = True
        return _eval_power

    # 0, 1 and -1 to any power stay small; a fraction's size is its larger part's
    numbers.Integer._eval_power = guard(numbers.Integer._eval_power, lambda n: abs(n.p).bit_length() * (abs(n.p) > 1))
    numbers.Rational._eval_power = guard(numbers.Rational._eval_power, lambda r: max(abs(r.p), r.q).bit_length())


def _guard_factorials(factorial) -> None:
    """Have sympy's exact factorial of an integer (`factorial`: sympy's class, which Gamma of an integer also
    evaluates through) raise `_Overtime` at once past EXACT_FACTORIAL_MAX. Math-Verify
    comparing (10^{100})! with an answer without a probe value works it out, and the soft alarm would ring
    only after the whole timeout: the verdict is the alarm's, given without the wait."""
    original = factorial.eval  # bound to the class
    if getattr(original, "guarded", False):
        return

    def eval(cls, n):
        if getattr(n, "is_Integer", False) and n.p > EXACT_FACTORIAL_MAX:
            raise _Overtime()
        return original(n)

    eval.guarded = True
    factorial.eval = classmethod(eval)


class _Checker:
    """Math-Verify with a parse cache and the numeric pre-filter (lives in an executor). A task verifier's
    executors run `verifiers.TaskChecker` instead, which has the same methods."""

    on_error = b"0\n"  # Math-Verify catches its own errors; anything else is "not equal"

    def __init__(self):
        import mpmath
        import sympy
        from latex2sympy2_extended.sets import FiniteSet
        from math_verify import parse, verify
        from sympy.core.random import seed

        self._mpmath, self._sympy, self._parse, self._verify = mpmath, sympy, parse, verify
        _guard_exact_powers(sympy.core.numbers)
        _guard_factorials(sympy.functions.combinatorial.factorials.factorial)
        self._set = FiniteSet  # the set class Math-Verify builds and flattens
        self.reseed = lambda: seed(0)
        self.parsed: dict[str, list] = {}
        self.values: dict[str, object] = {}

    def clear(self) -> None:
        self.parsed.clear()
        self.values.clear()

    def parse(self, answer: str) -> list:
        if answer not in self.parsed:
            parts = answer.split(PART_MARK)
            if len(parts) > 1:
                self.parsed[answer] = self._joined([self.parse(p.strip()) for p in parts])
            else:
                # Math-Verify's own timeouts are off: they would re-arm SIGALRM over our soft alarm.
                self.parsed[answer] = self._parse("\\boxed{" + answer + "}", parsing_timeout=None)
        return self.parsed[answer]

    def _joined(self, parts: list[list]) -> list:
        """Math-Verify's reading of several environments in one match (`$a$ and $b$`): one set of all their
        elements (sets flattened) when every one parses, else the first alone."""
        exprs = [p[0] if p and not isinstance(p[0], str) else None for p in parts]
        if any(e is None for e in exprs):
            return parts[0]
        elements = [x for e in exprs for x in (e.args if isinstance(e, self._set) else (e,))]
        return [self._set(*elements), " and ".join(str(p[-1]) for p in parts)]

    def prepare(self, answer: str) -> None:
        """Everything done per answer (parse, probe value), once: a comparison then only verifies."""
        self.parse(answer)
        self.value(answer)

    def single(self, answer: str) -> bytes:
        """An item with one answer: parse it ahead of the comparisons (`MathVerifier.prepare_many`)."""
        self.prepare(answer)
        return b"r" + encode_value(self.values[answer])  # the vote settles pairs whose values differ itself

    def value(self, answer: str):
        """The answer's value at the probe point (complex, or mpmath beyond float range); None where
        the filter does not apply, or fails."""
        if answer not in self.values:
            parsed = self.parse(answer)  # outside the try: its time is the item's, its failures Math-Verify's
            try:
                self.values[answer] = self._value(answer, parsed[0] if parsed else None)
            except Exception:  # noqa: BLE001 - a RecursionError on a matrix product, say: no value, Math-Verify decides
                self.values[answer] = None
        return self.values[answer]

    def _value(self, answer: str, expr):
        if any(tag in answer for tag in _NO_FILTER):
            return None
        exact = exact_number(answer)
        if exact is not None:
            return complex(float(exact))
        sympy = self._sympy
        expr = self._integrated(expr)
        if not (
            isinstance(expr, sympy.Expr)
            and not isinstance(expr, sympy.MatrixExpr)  # `3\begin{pmatrix}..` recurses in evalf until the limit
            and all(isinstance(x, sympy.Symbol) and len(x.name) == 1 for x in expr.free_symbols)
        ):
            return None
        try:
            # Substituted first, at 50 digits, then evaluated: evalf(subs=...) re-evaluates nested subterms at
            # rising precision, exponential in the nesting (a 14-deep fraction: seconds), this is linear.
            point = {x: self._sympy.Float(_probe(x.name), 50) for x in expr.free_symbols}
            number = expr.xreplace(point).evalf(15)
            out = complex(number)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError):
            return None  # no number at the probe point (a pole, a non-numeric atom)
        if cmath.isfinite(out):
            return out
        # Past float range, but maybe a finite number still (9^{9^9}): keep it in mpmath,
        # whose exponents are unbounded, rather than give up and leave it to Math-Verify.
        big = self._mpmath.mpmathify(number._to_mpmath(53))
        return big if self._mpmath.isfinite(big) else None

    def _integrated(self, expr):
        """`expr` with its integrals of polynomials worked out, as Math-Verify's simplify would (`\\int y`
        is x*y to it). An indefinite integral's variable is bound: a probe value put into it means nothing,
        so without this the answer had no value, and each comparison with it ran simplify (seconds beside
        a deep fraction). Other integrals stay: working them out may take longer than the timeout."""
        sympy = self._sympy
        integrals = expr.atoms(sympy.Integral) if isinstance(expr, sympy.Expr) else ()
        if not integrals or not all(
            i.function.is_polynomial(*i.variables) and not i.function.has(sympy.Integral) for i in integrals
        ):
            return expr
        return expr.xreplace({i: i.doit() for i in integrals})

    def differ(self, gold: str, pred: str) -> bool:
        """True when the probe-point values prove gold != pred; False when they do not, or cannot be compared."""
        return values_differ(self.value(gold), self.value(pred))

    def equal(self, gold: str, pred: str) -> bool:
        if self.differ(gold, pred):
            return False
        return bool(self._verify(self.parse(gold), self.parse(pred), timeout_seconds=None))


def _run_item(checker: _Checker, gold: str, pred: str | None, alarm_s: float, phase: mmap.mmap) -> bytes:
    """One item under the soft alarm, marking its progress in `phase` (the supervisor set it to g)."""
    # sympy's assumption system tries its rules in an order shuffled by its own random generator (seeded
    # from the OS at import): on degenerate answers (`0` vs `4 0/0`, nan either way) that order decides the
    # verdict. The same state for every item makes a verdict not depend on the run or on the items before.
    checker.reseed()
    signal.setitimer(signal.ITIMER_REAL, max(alarm_s, 1e-3))
    try:
        if pred is None:
            return checker.single(gold) + b"\n"
        checker.prepare(gold)
        phase[0] = ord("p")
        checker.prepare(pred)
        phase[0] = ord("v")
        return b"1\n" if checker.equal(gold, pred) else b"0\n"
    except _Overtime:
        return b"t\n"
    except Exception:  # noqa: BLE001 - Math-Verify: "not equal"; a task verifier's error: "e", counted
        return checker.on_error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _executor_main(rfd: int, wfd: int, phase: mmap.mmap, supervisor_pid: int, make_checker=None) -> None:
    """Serve items from the supervisor until it closes the pipe. make_checker: the task verifier's
    checker (`verifiers.TaskChecker`), None for Math-Verify's."""
    _die_with(supervisor_pid)
    _close_fds_except({0, 1, 2, rfd, wfd})
    devnull = os.open(os.devnull, os.O_RDONLY)  # fd 0 was the parent's request pipe
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGALRM, _ring)
    checker = _Checker() if make_checker is None else make_checker()
    crash_on = faults.GRADER_CRASH_GOLD if faults.hit("grader_crash") else None  # the recovery's test fault
    while True:
        message = _read_message(rfd)
        if message is None:
            return
        gold, pred, alarm_s, clear = message
        if gold == crash_on:
            faults.crash()
        if clear:
            checker.clear()
        try:
            result = _run_item(checker, gold, pred, alarm_s, phase)
        except _Overtime:  # the alarm rang while the item was being wound up
            result = b"t\n"
        os.write(wfd, result)


def _die_with(supervisor_pid: int) -> None:
    """Be killed when the supervisor dies (Linux), so no hung executor outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != supervisor_pid:
        os._exit(0)


def _close_fds_except(keep: set[int]) -> None:
    """Close inherited descriptors: another executor's pipe held open here would hide its death."""
    top = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536
    low = 0
    for fd in sorted(keep) + [top]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
