"""Math-Verify worker: a child process that compares answer pairs.

Started by `trapo.rewards.verifier.MathVerifier` as
`python -m trapo.rewards.verify_worker`. Protocol on stdin/stdout:

- after importing Math-Verify it writes the line `ready`;
- it reads one pickled request (4-byte big-endian length, then pickle):
  a list of (gold, pred) answer strings (boxed contents, not responses);
- for each pair, in order, it writes a line `<0|1>` as soon as it is known.

It runs Math-Verify in its own main thread, so Math-Verify's signal-based
timeouts work here whatever thread the trainer grades from; the parent
kills this process when one pair overruns the hard deadline (a C-level
computation such as 9^(9^(9^9)) never returns to Python to see a signal).

Numeric pre-filter: each side that parses to a scalar expression is
evaluated at one fixed probe point (every single-letter variable gets its own
irrational-looking value). Expressions that are equal must agree there, so
values that differ by more than 1e-4 relative prove "not equal" (Math-Verify
compares numbers after rounding to 6 decimals) and the slow symbolic path
(up to 300 ms of sympy simplify for `-13x+3` vs `350`) is skipped. Answers
with text or units that change the value on parsing (percent, degrees) are
never pre-filtered; neither are multi-letter symbols, sets, tuples or
relations.
"""

from __future__ import annotations

import cmath
import os
import pickle
import struct
import sys

from trapo.rewards.answers import exact_number

_CACHE_LIMIT = 50_000
_NO_FILTER = ("%", "circ", "degree", "text", "mathrm", "mbox")


def _probe(name: str) -> float:
    """The probe-point value of variable `name`: distinct per letter, not a round number."""
    return 0.6180339887 + 0.7071067812 * (ord(name) % 29)


def _serve() -> None:
    # The protocol gets a private copy of stdout; fd 1 then points at stderr,
    # so a stray print() in a library cannot corrupt the stream.
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import logging

    import sympy
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are reported by the parent

    internal_timeout = int(os.environ.get("TRAPO_MV_INTERNAL_TIMEOUT", "4"))
    parsed: dict[str, list] = {}
    values: dict[str, complex | None] = {}

    def parse_cached(answer: str) -> list:
        if answer not in parsed:
            if len(parsed) > _CACHE_LIMIT:
                parsed.clear()
                values.clear()
            parsed[answer] = parse("\\boxed{" + answer + "}", parsing_timeout=internal_timeout)
        return parsed[answer]

    def value(answer: str) -> complex | None:
        """The answer's value at the probe point, or None where the filter does not apply."""
        if answer in values:
            return values[answer]
        out = None
        if not any(tag in answer for tag in _NO_FILTER):
            exact = exact_number(answer)
            if exact is not None:
                out = complex(float(exact))
            else:
                items = parse_cached(answer)
                expr = items[0] if items else None
                if isinstance(expr, sympy.Expr) and all(
                    isinstance(x, sympy.Symbol) and len(x.name) == 1 for x in expr.free_symbols
                ):
                    try:
                        out = complex(expr.evalf(15, subs={x: _probe(x.name) for x in expr.free_symbols}))
                    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
                        out = None
                    if out is not None and not cmath.isfinite(out):
                        out = None
        values[answer] = out
        return out

    def equal(gold: str, pred: str) -> bool:
        vg, vp = value(gold), value(pred)
        if vg is not None and vp is not None:
            scale = max(1.0, abs(vg), abs(vp))
            if abs(vg - vp) > 1e-4 * scale:
                return False
        return bool(verify(parse_cached(gold), parse_cached(pred), timeout_seconds=internal_timeout))

    # Math-Verify's first parse of each kind of answer pays one-off set-up
    # (regexes, the LaTeX grammar): pay it here, before saying ready.
    for warm in ("1", "\\frac{1}{2}", "x^2+1", "(1,2)", "[1,2)", "\\{1,2\\}", "1+2i", "x=1", "\\text{A}"):
        equal(warm, warm)
    parsed.clear()
    values.clear()
    stdin = sys.stdin.buffer
    stdout.write("ready\n")
    stdout.flush()
    while True:
        header = stdin.read(4)
        if len(header) < 4:
            return  # parent closed the pipe
        (size,) = struct.unpack(">I", header)
        pairs = pickle.loads(stdin.read(size))
        for gold, pred in pairs:
            try:
                ok = equal(gold, pred)
            except Exception:  # noqa: BLE001 - any failure to compare is "not equal"
                ok = False
            stdout.write("1\n" if ok else "0\n")
            stdout.flush()


if __name__ == "__main__":
    _serve()
