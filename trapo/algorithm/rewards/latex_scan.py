"""The LaTeX scanning under answer extraction: a response's boxes and math environments, found in linear time.

`_Text` is the response with memoised forward searches and the positions of its boxes; `_boxes` reads
the boxes of a span as Math-Verify does (their closing braces, which ones join); `_env` finds the math
environment that opens at a position ($..$, $$..$$, \\[..\\], \\(..\\), [..]) and `_reaching` the
openers that can reach a box. Which of these make the answer, and in what order, is
`trapo.algorithm.rewards.extraction`.
"""

from __future__ import annotations

import bisect
import re

from trapo.algorithm.rewards.answers import MAX_ANSWER_CHARS

_BUDGET = 2 * MAX_ANSWER_CHARS  # characters an answer may gather; beyond, it is certainly too long (scored 0)
_COMMAND = re.compile(r"\\(?:boxed|fbox)")
_OPEN_BOX = re.compile(r"\\boxed\{")
_BRACE = re.compile(r"[{}]")
_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]")  # what lets two boxes 10-69 characters apart join
# Openers of math environments: the text each needs, where it is, the width, what ends (or breaks) its content.
_OPENERS = (
    ("$$", re.compile(r"(?=\$\$)"), 2, ("$$",)),
    ("\\[", re.compile(r"\\\["), 2, ("\\]",)),
    ("$", re.compile(r"\$"), 1, ("$", "\n")),
    ("\\(", re.compile(r"\\\("), 2, ("\\)", "\n")),
    ("[", re.compile(r"\s(?=\[)"), 2, ("[", "]", "\n")),
)
_FRACTION = re.compile(r"-?\\frac\{-?\d+(?:[.,]\d+)?\}\{-?\d+(?:[.,]\d+)?\}")


# ----------------------------------------------------------------------------- the text


class _Text:
    """A response with memoised forward searches: scanning it left to right costs linear time."""

    def __init__(self, s: str):
        self.s, self.n = s, len(s)
        self._found: dict[str, tuple[int, int]] = {}
        self.commands = [m.start() for m in _COMMAND.finditer(s)]  # \boxed and \fbox, as Math-Verify looks for them
        self.opens = [m.start() for m in _OPEN_BOX.finditer(s)]  # \boxed{ as its patterns require it

    def find(self, sub: str, start: int) -> int:
        """s.find(sub, start), with n for none. Reuses the last search for `sub` when it covers `start`."""
        seen = self._found.get(sub)
        if seen is not None and seen[0] <= start <= seen[1]:
            return seen[1]
        at = self.s.find(sub, start)
        at = self.n if at < 0 else at
        self._found[sub] = (start, at)
        return at

    def dollar(self, start: int) -> int:
        """The first `$` at or after start that no backslash escapes."""
        q = self.find("$", start)
        while q < self.n and q > 0 and self.s[q - 1] == "\\":
            q = self.find("$", q + 1)
        return q

    def holds(self, lo: int, hi: int, boxed: bool) -> bool:
        """Whether s[lo:hi] is content for an environment: non-empty, and with a closed box when `boxed`."""
        if not boxed:
            return hi > lo
        k = bisect.bisect_left(self.opens, lo)
        if k == len(self.opens) or self.opens[k] + 8 >= hi:
            return False
        return self.find("}", self.opens[k] + 8) < hi  # `\\boxed{`, at least one character, `}`

    def skip_space(self, i: int) -> int:
        while i < self.n and self.s[i].isspace():
            i += 1
        return i


# ----------------------------------------------------------------------------- boxes


def _closing(s: str, brace: int, limit: int) -> int | None:
    """Index of the `}` that closes the `{` at `brace`, before `limit`; None if it does not close."""
    depth = 1
    for m in _BRACE.finditer(s, brace + 1, limit):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


def _boxes(t: _Text, lo: int, hi: int, last: bool) -> str | None:
    """The boxes of s[lo:hi] as Math-Verify reads them; s[lo:hi] itself when it has none.

    Right to left, box by box. `last` (a bare \\boxed{} match): stop at the first box too far from the
    next one (see the module doc); otherwise (a math environment) take them all. Repeats in a row
    count once. None where the rightmost box never closes.
    """
    s = t.s
    parts: list[str] = []
    size = 0
    limit, right = hi, None  # a box must close before the box to its right starts
    k = bisect.bisect_left(t.commands, hi) - 1
    while k >= 0 and t.commands[k] >= lo:
        start = t.commands[k]
        k -= 1
        command_end = start + (6 if s.startswith("\\boxed", start) else 5)
        if command_end > limit:
            continue  # not wholly inside the span
        i = t.skip_space(command_end)
        if i >= limit:
            break
        if s[i] != "{":  # `\boxed 5`: the rest is the answer, when nothing was found yet
            if not parts:
                return s[i:hi].strip()
            break
        close = _closing(s, i, limit)
        if close is None:
            return None if not parts else ",".join(reversed(parts))
        content = s[i + 1 : close].strip()
        if last and right is not None and not _joins(s, close + 1, right, content, parts[-1] if parts else ""):
            break
        if not parts or parts[-1] != content:
            parts.append(content)
            size += len(content) + 1
        limit = right = start
        if size > _BUDGET:
            break
    if not parts:
        return s[lo:hi].strip()
    return ",".join(reversed(parts))


def _joins(s: str, lo: int, hi: int, content: str, after: str) -> bool:
    """Whether a box with `content` joins the answer, s[lo:hi] lying between it and the box after it."""
    if hi - lo < 10:
        return True
    return content != after and hi - lo < 70 and _SEPARATOR.search(s, lo, hi) is not None


# ----------------------------------------------------------------------------- math environments


def _env(t: _Text, p: int, boxed: bool) -> tuple[int, int, int] | None:
    """The math environment that opens at p, as (content start, content end, end); None if none.

    Tried in Math-Verify's order: $$..$$, \\[..\\], $..$ (one line, not after a digit), \\(..\\) (one
    line), then a space and [..] and a space; an unescaped closer; content that `holds`. Without
    `boxed`, a bare \\frac{a}{b} of plain numbers is one too.
    """
    s, n = t.s, t.n
    if p >= n:
        return None
    prev = s[p - 1] if p else ""
    if prev != "\\":
        if s.startswith("$$", p):
            q = t.find("$$", p + 2)
            if q < n and s[q - 1] != "\\" and t.holds(p + 2, q, boxed):
                return p + 2, q, q + 2
        if s.startswith("\\[", p):
            q = t.find("\\]", p + 2)
            if q < n and s[q - 1] != "\\" and t.holds(p + 2, q, boxed):
                return p + 2, q, q + 2
        if s[p] == "$" and not prev.isdecimal():
            q = t.dollar(p + 1)
            if q < n and q < t.find("\n", p + 1) and t.holds(p + 1, q, boxed):
                return p + 1, q, q + 1
        if s.startswith("\\(", p):
            q = t.find("\\)", p + 2)
            if q < n and s[q - 1] != "\\" and q < t.find("\n", p + 2) and t.holds(p + 2, q, boxed):
                return p + 2, q, q + 2
    if s[p].isspace() and s.startswith("[", p + 1):
        q = min(t.find("]", p + 2), t.find("[", p + 2), t.find("\n", p + 2))
        if q < n - 1 and s[q] == "]" and s[q + 1].isspace() and t.holds(p + 2, q, boxed):
            return p + 2, q, q + 2
    if not boxed:
        m = _FRACTION.match(s, p)
        if m:
            return p, m.end(), m.end()
    return None


def _env_after_space(t: _Text, p: int, boxed: bool) -> tuple[int, int, int] | None:
    """An environment at p, where p ends a run of spaces: `[..]` then opens on the run's last space."""
    env = _env(t, p, boxed)
    if env is None and p > 0 and t.s.startswith("[", p) and t.s[p - 1].isspace():
        env = _env(t, p - 1, boxed)
    return env


def _reaching(t: _Text, opener: re.Pattern, width: int, stops: tuple[str, ...]) -> list[int]:
    """Positions of `opener` (content from there + width) with none of `stops` between the content and
    the next box. Each stretch of text is searched once."""
    s, out, done = t.s, [], -1  # openers up to `done` are settled
    for b in t.opens:
        hi = b - width  # the last opener whose content can start by b
        if hi <= done:
            continue
        lo = done + 1
        stop = max(_last(s, sub, lo + width, b) for sub in stops)  # a stop there blocks the openers before it
        lo = max(lo, stop - width + 1)
        out += [m.start() for m in opener.finditer(s, lo, hi + width)]
        done = hi
    return out


def _last(s: str, sub: str, lo: int, hi: int) -> int:
    """The last occurrence of `sub` in s[lo:hi]; a `$` only if no backslash escapes it. -1 if none."""
    at = s.rfind(sub, lo, hi)
    while sub == "$" and at > 0 and s[at - 1] == "\\":
        at = s.rfind(sub, lo, at)
    return at
