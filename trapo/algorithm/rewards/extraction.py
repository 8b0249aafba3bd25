"""What counts as the answer of a response: Math-Verify's reading of the whole text, as one answer string.

The paper's reward hands Math-Verify 0.9 the whole response (veRL's
math_verify reward, the gold wrapped in \\boxed{}). Its `parse` tries
extraction patterns by priority; within a priority, the match that ends last
first (then the one that starts first); the first match that parses is the
answer. `extract_answer` follows the two priorities at which a response
states its answer, and returns the string `a` for which Math-Verify's
parse("\\boxed{a}") reads what parse(response) reads, so that the exact fast
paths, the workers' parse caches and the vote all keep working on strings.

Priority 0: "final answer is X. I hope" (the Minerva format).
Priority 50, the match that ends last:
- the boxes: from the last \\boxed{} leftwards, a box joins the answer while it
  is close to the one after it (under 10 characters apart, or under 70 with
  `and`, `or`, a comma or a semicolon between and a different content);
  contents are joined with commas, so `\\boxed{1},\\boxed{2}` answers `1,2`;
- a math environment ($..$, $$..$$, \\[..\\], \\(..\\), [..]) holding a box:
  all the boxes in it, and in up to five more such environments joined to it
  by `and`, `or` or a comma;
- "final answer" then, within 100 characters, "is", then such environments
  (boxed or not, or a bare \\frac{a}{b}), a number (`10,455`, `$12`, `28%`)
  or a plain arithmetic expression (`2^10`, read as Python reads it).

Math-Verify parses each environment of a match alone and makes one set of
them all; such an answer's parts are joined with PART_JOIN, which the
workers split to do the same.

Where Math-Verify would fall back on lower priorities, we do not, on purpose:
a response that neither boxes nor states a final answer has none (not the
last number in the text, not whatever follows the word "answer"), and a box
still open when the response ends (cut off at the length limit) is no
answer. A match Math-Verify fails to parse makes it try the next one; we
foresee that only for empty answers, unbalanced braces and expressions
Python cannot read.

Every step is a bounded scan: memoised forward searches, box positions
found once, only the openers that can reach a box, an answer budget; the
regular expressions used run in linear time.
"""

from __future__ import annotations

import ast
import re
from decimal import Decimal

from trapo.algorithm.rewards.answers import PART_JOIN, PART_MARK, extract_boxed
from trapo.algorithm.rewards.latex_scan import (
    _BUDGET,
    _OPENERS,
    _boxes,
    _env,
    _env_after_space,
    _reaching,
    _Text,
)

_CHAIN = 5  # environments Math-Verify joins to the first of a match
_REACH = 100  # characters "final answer" may run before its "is"
_WS_RUN = 256  # longest whitespace before "is" that is looked for
_CURRENCY = frozenset("$€£¥₹₽₪₩₫฿₡₢₣₤₥₦₧₨₭₮₯₰₱₲₳₴₵₶₷₸₺₻₼₾₿")
_OPERATORS = frozenset("+-*×/^()÷")
_SUFFIX = frozenset(".,:)$")
_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character, or a brace
_ANCHOR = re.compile("final answer", re.IGNORECASE)
_ANCHOR_IS = re.compile("final answer is", re.IGNORECASE)
_SPACE_IS = re.compile(r"\s+is")
_PERCENT = re.compile(r"\s*(\\?%|[Pp]ercent|[Pp]ct)?")
_JOIN = re.compile(r"\s*(?:,?and|,?or|,)\s*")
_HOPE = re.compile(r"\s*(\\?%|[Pp]ercentage|[Pp]ercent|[Pp]ct)?\.?\s?I hope")
_HOPE_AFTER = re.compile(r"\.?\s?I hope")
_EXPR_RUN = re.compile(r"[\d.\s+\-*×/^()÷]*")
_NUMBER = re.compile(
    r"(?:(?P<i1>-?[1-9]\d{0,2}(?:[ ,]\d{3})+)(?P<d1>\.\d+)?|(?P<i2>-?\d+)(?P<d2>[.,]\d+)|(?P<d3>\.\d+)|(?P<i3>-?\d+))"
    r"(?P<pct>\s*(?:%|[Pp]ercent|\s*[Pp]ercentage|\s*[Pp]ct))?"
)
_NUMBER_HOPE = re.compile(_NUMBER.pattern + r"\.?\s?I hope")


def extract_answer(text: str) -> str | None:
    """The answer a response states, as Math-Verify reads it (see the module doc); None without one.

    Several boxes give one comma-joined string (`(2, 2),(6, 2)`), several environments one joined with
    PART_JOIN. Without a box or a final-answer statement, the last `\\fbox{}` or `\\boxed 5` still counts,
    as it always has here.
    """
    t = _Text(text)
    for priority in (_priority_0, _priority_50):
        # Math-Verify's order: the match that ends last, then the one that starts first, then pattern order.
        for _end, _start, _order, answer in sorted(priority(t), key=lambda c: (-c[0], c[1], c[2])):
            if _readable(answer):
                return answer
    return extract_boxed(text)


def _readable(answer: str | None) -> bool:
    """False where Math-Verify certainly fails to parse the answer (and so tries its next match): nothing
    there, or braces that do not balance (LaTeX's parser rejects them; `\\{` and `\\}` are set braces)."""
    if not answer:
        return False
    depth = 0
    for m in _TOKEN.finditer(answer):
        if m.group() == "{":
            depth += 1
        elif m.group() == "}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


# ----------------------------------------------------------------------------- boxes


def _bare_boxes(t: _Text) -> list[tuple]:
    """Math-Verify's `\\boxed{.+}` match: from the first \\boxed{ to the last `}` of the text."""
    if not t.opens:
        return []
    first, last = t.opens[0], t.s.rfind("}")
    if last < first + 8:
        return []
    answer = _boxes(t, first, last + 1, last=True)
    return [(last + 1, first, 2, answer and answer.replace(PART_MARK, " "))]  # PART_MARK is ours alone


# ----------------------------------------------------------------------------- math environments


def _chain(t: _Text, env: tuple[int, int, int], boxed: bool) -> tuple[int, int, str | None]:
    """Environment `env` (see `_env`) and those joined to it: (end of the last closer, end, answer).

    Each environment is read for its boxes (all of them) and may be followed by a percent sign. Math-Verify
    parses each alone and makes a set of them all (the parts are joined with PART_JOIN, which the workers
    split); one that fails leaves only the first: here, one that is not `_readable`.
    """
    s = t.s
    parts: list[str | None] = []
    while True:
        pct = _PERCENT.match(s, env[2])
        part = _boxes(t, env[0], env[1], last=False)
        if part:
            part = part.replace(PART_MARK, " ") + ("\\%" if pct.group(1) else "")
        parts.append(part)
        closer, end = env[2], pct.end()
        if len(parts) > _CHAIN:
            break
        join = _JOIN.match(s, end)
        env = join and _env_after_space(t, join.end(), boxed)
        if env is None:
            break
    if boxed:
        end = t.skip_space(end)  # the boxed pattern's spaces between optional groups are taken even when unused
    if not all(_readable(p) for p in parts):
        return closer, end, parts[0] if _readable(parts[0]) else None
    return closer, end, PART_JOIN.join(parts)


def _boxed_environments(t: _Text) -> list[tuple]:
    """Math-Verify's matches of math environments holding boxes, found left to right as `re.finditer` would.

    Only an opener that can reach a box is tried (an attempt that fails takes nothing, so skipping the
    others changes nothing): one with no closer of its kind between it and the next box.
    """
    if not t.opens:
        return []
    last = t.opens[-1]
    starts = {p for mark, *kind in _OPENERS if t.s.find(mark, 0, last) >= 0 for p in _reaching(t, *kind)}
    found, pos = [], 0
    for p in sorted(starts):
        if p < pos:
            continue
        env = _env(t, p, boxed=True)
        if env is not None:
            chain = _chain(t, env, boxed=True)
            found.append((chain[1], p, 1, chain[2]))
            pos = chain[1]
    return found


# ----------------------------------------------------------------------------- stated final answers


def _priority_0(t: _Text) -> list[tuple]:
    """Candidates (end, start, pattern order, answer or None) of "final answer is X. I hope"."""
    s = t.s
    first: list[tuple] = []
    latex_from = plain_from = 0
    for m in _ANCHOR_IS.finditer(s):
        u = m.end() + s.startswith(":", m.end())
        v = t.skip_space(u)
        env = _env_after_space(t, v, False) if m.start() >= latex_from else None
        if env is not None:
            chain = _chain(t, env, boxed=False)
            hope = _HOPE.match(s, chain[0])
            if hope:
                answer = chain[2]
                if answer and hope.group(1) and not answer.endswith("\\%"):
                    answer += "\\%"
                first.append((hope.end(), m.start(), 0, answer))
                latex_from = hope.end()
        if m.start() >= plain_from:
            # \s* then the number's own lead: one space (given back by \s*) or an `=`
            for x in ([v + 1] if s.startswith("=", v) else []) + ([v] if v > u else []):
                found = _plain(t, x, hope=True)
                if found is not None:
                    first.append((found[0], m.start(), 3, found[1]))
                    plain_from = found[0]
                    break
    return first


def _priority_50(t: _Text) -> list[tuple]:
    """Candidates at priority 50: the bare boxes, environments holding boxes, "final answer ... is X"."""
    return _bare_boxes(t) + _boxed_environments(t) + _final_answer_is(t)


def _final_answer_is(t: _Text) -> list[tuple]:
    """Matches of "final answer", up to 100 characters, whitespace, "is", then environments or a number."""
    s = t.s
    out: list[tuple] = []
    latex_from = plain_from = 0
    for m in _ANCHOR.finditer(s):
        a, reach = m.start(), m.end() + _REACH
        want_latex, want_plain = a >= latex_from, a >= plain_from
        newline = t.find("\n", m.end())  # the plain pattern's 100 characters stay on the line
        for w in _SPACE_IS.finditer(s, m.end(), min(t.n, reach + 1 + _WS_RUN)):
            if w.start() > reach or not (want_latex or want_plain):
                break
            u = w.end() + s.startswith(":", w.end())
            if want_latex:
                env = _env_after_space(t, t.skip_space(u), False)
                if env is not None:
                    chain = _chain(t, env, boxed=False)
                    out.append((chain[1], a, 0, chain[2]))
                    latex_from, want_latex = chain[1], False
            if want_plain and w.start() <= newline and u < t.n and (s[u].isspace() or s[u] == "="):
                found = _plain(t, u + 1)
                if found is not None:
                    out.append((found[0], a, 3, found[1]))
                    plain_from, want_plain = found[0], False
    return out


# ----------------------------------------------------------------------------- plain numbers and expressions


def _plain(t: _Text, x: int, hope: bool = False) -> tuple[int, str | None] | None:
    """A plain expression or number at x (after an optional `**`), as (end, answer); None if neither.

    hope: it must be followed by ". I hope" (priority 0), which may make the expression shorter or the
    number another of its forms (`1,2345. I hope` is 1.2345), as the regular expression's backtracking
    would; the end is then past "I hope". The answer is None where the expression cannot be read.
    """
    s = t.s
    if s.startswith("**", x):
        x += 2
    expr = _expression(t, x, hope)
    if expr is not None:
        return expr
    m = (_NUMBER_HOPE if hope else _NUMBER).match(s, x + (x < t.n and s[x] in _CURRENCY))
    if m is None:
        return None
    integer = (m["i1"] or m["i2"] or m["i3"] or "").translate({ord(","): None, ord(" "): None}).lstrip("0") or "0"
    number = integer + (m["d1"] or m["d2"] or m["d3"] or "").replace(",", ".")
    return m.end(), number + ("\\%" if m["pct"] else "")


def _expression(t: _Text, x: int, hope: bool) -> tuple[int, str | None] | None:
    """Math-Verify's plain expression at x: digits and + - * × / ^ ( ) ÷ with an operator after the first
    digit, closed by `.`, `,`, `:`, a space, `)`, `$` or the end, as (end, answer in LaTeX).

    The longest such span, as the greedy regular expression finds it (or the longest followed by
    ". I hope", with `hope`).
    """
    s, n = t.s, t.n
    d = x
    for sign in "-(-":
        if d < n and s[d] == sign:
            d += 1
    if d >= n or not s[d].isdecimal():
        return None
    run_end = _EXPR_RUN.match(s, d + 1, min(n, d + 1 + _BUDGET)).end()
    if run_end == d + 1 + _BUDGET:
        return None  # longer than any answer: not read
    operator = next((o for o in range(d + 1, run_end) if s[o] in _OPERATORS), n)
    for e in range(run_end, operator + 1, -1):  # at least one character between the operator and e
        for stop in (e + 1, e) if e < n and s[e] == ")" else (e,):
            end = _closed(s, stop)
            if end is not None and hope:
                tail = _HOPE_AFTER.match(s, end)
                end = tail.end() if tail else None
            if end is not None:
                return end, _arithmetic_latex(s[x:stop])
    return None


def _closed(s: str, i: int) -> int | None:
    """The end of what closes an expression at i (optional `**`, then `.`, `,`, `:`, a space, `)`, `$` or
    the end of the text); None if nothing does."""
    for j in (i + 2, i) if s.startswith("**", i) else (i,):
        if j >= len(s):
            return len(s)
        if s[j] in _SUFFIX or s[j].isspace():
            return j + 1
    return None


def _arithmetic_latex(expr: str) -> str | None:
    """LaTeX for an arithmetic expression as sympy's parse_expr reads it (`^` is a power, `2^10` 1024);
    None where parse_expr would fail or read something else (an implicit product `2(3)`, a complex literal)."""
    try:
        return _latex(ast.parse(expr.replace("\n", " ").replace("^", "**").strip(), mode="eval").body)[0]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _latex(node: ast.AST) -> tuple[str, bool]:
    """(LaTeX, whether it needs no parentheses as an operand)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        text = format(Decimal(repr(node.value)), "f")  # never `1e-05`, which LaTeX reads as 1*e - 5
        if not text[-1].isdigit():
            raise ValueError("not finite")
        return text, True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _group(node.operand)
        return (f"-{operand}" if isinstance(node.op, ast.USub) else operand), False
    if isinstance(node, ast.BinOp):
        left, right = _group(node.left), _group(node.right)
        if isinstance(node.op, ast.Add):
            return f"{left}+{right}", False
        if isinstance(node.op, ast.Sub):
            return f"{left}-{right}", False
        if isinstance(node.op, ast.Mult):
            return f"{left}\\cdot {right}", False
        if isinstance(node.op, ast.Div):
            return f"\\frac{{{_latex(node.left)[0]}}}{{{_latex(node.right)[0]}}}", True
        if isinstance(node.op, ast.Pow):
            return f"{{{left}}}^{{{_latex(node.right)[0]}}}", True
    raise ValueError(f"not plain arithmetic: {type(node).__name__}")


def _group(node: ast.AST) -> str:
    text, atomic = _latex(node)
    return text if atomic else f"({text})"
