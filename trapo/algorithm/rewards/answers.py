"""Answer strings: extraction from responses and cheap, exact comparisons.

Pure string functions, no sympy, no torch: also imported by the Math-Verify
worker process. Everything here either decides a comparison with certainty
or says "don't know" (None) and leaves it to Math-Verify.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 2000  # a boxed answer longer than this is not an answer (scores 0)
# Joins the parts of an answer that Math-Verify reads from several math environments at once
# (`$a$ and $b$`): it parses each part alone and makes one set of them all, and so do the workers
# (`trapo.engine.grading.executor`). Parsed together, `$10,455$ and $7$` would be {10, 455, 7}.
PART_MARK = "⟨and⟩"
PART_JOIN = f" {PART_MARK} "

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_SPACING = re.compile(r"\\[,;: ]|\\quad|\\qquad|\\displaystyle|\\left(?![A-Za-z])|\\right(?![A-Za-z])|\$")
_NEGATIVE_SPACE = re.compile(r"\\!\s*")  # deleted, as Math-Verify deletes it: `1\!000` is 1000
_SPACE_RUN = re.compile(r"\s+")
# After runs of spacing are one space, that space is dropped except between two alphanumerics:
# `1 5`, `1  5` and `1 \quad 5` are all 1+5 to Math-Verify, not 15, and `\pi r` must not become `\pir`.
_LOOSE_SPACE = re.compile(r"(?<![A-Za-z0-9]) | (?![A-Za-z0-9])")
_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|textrm)\{(.*)\}$", re.S)
_LETTER = re.compile(r"^\(?([A-Ja-j])\)?[.:]?$")
_INT = re.compile(r"^[+-]?\d+$")
_DEC = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+)$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{(\d+)\}$")
_SLASH = re.compile(r"^([+-]?\d+)/(\d+)$")
_MAX_DIGITS = 300  # beyond this a "number" is left to Math-Verify (and its timeout)


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed 5`) in text.

    Braces are matched, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. An
    unclosed last box, an empty box or none at all gives None. Linear time.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = text.index("\\", start) + 1
    while i < len(text) and text[i].isalpha():
        i += 1
    rest = text[i:]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        # `\boxed 5` form: the answer runs to the next whitespace or `$`.
        token = re.match(r"\s*([^\s$]+)", rest)
        return token.group(1) if token else None
    rest_start = i + (len(rest) - len(rest.lstrip()))
    if rest_start >= len(text) or text[rest_start] != "{":
        return None
    depth = 0
    for j in range(rest_start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                content = text[rest_start + 1 : j].strip()
                return content or None
    return None


def normalize(answer: str) -> str:
    """Strip what never changes an answer's meaning: spacing (see _LOOSE_SPACE), \\left/\\right, $,
    \\dfrac/\\tfrac spellings, a trailing period, one \\text{} wrapper."""
    s = _SPACE_RUN.sub(" ", _SPACING.sub(" ", _NEGATIVE_SPACE.sub("", answer))).strip()
    s = _LOOSE_SPACE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.rstrip(".")
    wrapped = _WRAPPER.match(s)
    return wrapped.group(1) if wrapped else s


def choice_letter(answer: str) -> str | None:
    """'B', '(b)', '\\text{B}', 'B.' -> 'B'; anything else -> None."""
    m = _LETTER.match(normalize(answer))
    return m.group(1).upper() if m else None


def is_choice_gold(gold: str) -> bool:
    """A multiple-choice gold is a single letter A-J."""
    return re.fullmatch(r"\s*[A-J]\s*", gold) is not None


def exact_number(answer: str) -> Fraction | None:
    """The exact value of an integer, decimal or simple fraction; else None."""
    s = normalize(answer)
    if len(s) > _MAX_DIGITS:
        return None
    if _INT.match(s) or _DEC.match(s):
        return Fraction(s)
    m = _FRAC.match(s) or None
    if m:
        sign, num, den = m.groups()
        value = Fraction(int(num), int(den)) if int(den) else None
        return -value if value is not None and sign == "-" else value
    m = _SLASH.match(s)
    if m and int(m.group(2)):
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def fast_equal(gold: str, pred: str) -> bool | None:
    """Decide gold == pred when it is certain without sympy; None when not.

    - equal after `normalize`: equal;
    - both exact numbers (int, decimal, a/b, \\frac{a}{b}): equal iff equal
      values, except that two numbers whose difference is below Math-Verify's
      rounding (1e-6) are left to it.
    """
    g, p = normalize(gold), normalize(pred)
    if g == p and g:
        return True
    vg, vp = exact_number(g), exact_number(p)
    if vg is None or vp is None:
        return None
    if vg == vp:
        return True
    if abs(vg - vp) > Fraction(1, 10**4) * max(1, abs(vg), abs(vp)):
        return False
    return None


def values_differ(a, b) -> bool:
    """True when two answers' probe-point values (the grading executors' numeric pre-filter: complex, or mpmath
    beyond float range) prove the answers unequal: more than 1e-4 apart, relative (Math-Verify compares
    numbers rounded to 6 decimals). None, or values that cannot be compared, prove nothing (False)."""
    if a is None or b is None:
        return False
    try:
        return bool(abs(a - b) > 1e-4 * max(1.0, abs(a), abs(b)))
    except Exception:  # noqa: BLE001 - values it cannot compare prove nothing
        return False
