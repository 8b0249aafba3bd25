"""Majority vote over degenerate answers: 8 distinct answers that each exhaust the Math-Verify timeout.

The answers are exponent towers 9^{9^{9^{k}}}: evaluating one runs into any
timeout (a collapsed policy emitting garbage, as the paper describes for
unsupervised training, could answer like this). All distinct, so the TTRL
pseudo-label is none (8 singletons). Prints, side by side in one run, the
seconds of one vote and their ratio to the timeout (target: ours <= 2.5 x):

- ours: `majority_votes` on a fresh `MathVerifier` (start-up excluded): the
  answers that need Math-Verify are parsed once, side by side, before any
  comparison; one that exhausts the timeout is frozen, never compared;
- before: the vote as it was before, reimplemented here: round r compares
  the r-th distinct answer with every cluster, over worker processes that
  wait out each comparison's timeout, then kill the worker and start a fresh
  one (a new Math-Verify import) for the pairs still queued on it.

Then a vote over 64 mixed degenerate answers (long digit strings, some raised
to long powers; nested fractions; garbage LaTeX; exponent towers; a quarter
of them repeats, as a collapsed policy repeats itself), against grading the
same 64 answers one by one against a gold: the vote should cost at most 1.5x
the grading (it parses each answer once and waits on a slow one at most
once). Three answer sets (seeds), each side on a fresh verifier (cold parse
caches), in alternating order. Then the same side by side on a second mix
(`collapse_mix`, two shuffles: code-injection strings, heavy answers, some of
which parse in time but make comparisons run out of it, broken LaTeX and odd
unicode, fuzz strings of LaTeX tokens), held to the same 1.5x and to at most
15 timeouts in the vote. Saves the lines to outputs/bench/vote.txt and writes
the `bench-vote` block of docs/benchmarks.md (`--no-docs`: not).

    PYTHONPATH=. python bench/bench_vote.py [--timeout 5] [--workers 2] [--mixed-timeout 2]
"""

from trapo import runtime

runtime.configure()  # bounded threads before torch or Math-Verify is imported

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import random  # noqa: E402
import select  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

from trapo.algorithm.rewards import Tally, majority_votes  # noqa: E402
from trapo.algorithm.rewards.answers import MAX_ANSWER_CHARS, normalize  # noqa: E402
from trapo.algorithm.rewards.verifiable import answer_rewards, fast_verdict  # noqa: E402
from trapo.engine.grading.verifier import MathVerifier  # noqa: E402

ANSWERS = [f"9^{{9^{{9^{{{k}}}}}}}" for k in range(4, 12)]
TARGET_RATIO = 2.5
MIXED_TARGET = 1.5  # a vote over mixed degenerate answers / grading them one by one
COLLAPSE_TIMEOUTS = 15  # the most timeouts a vote over the 64 answers of collapse_mix may count
MIXED_GOLD = "\\frac{3}{7}"
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- today's vote, for reference


def legacy_worker(internal_timeout: int) -> None:
    """Today's worker process: Math-Verify with its own SIGALRM timeouts, a parse cache, the numeric pre-filter."""
    import cmath
    import logging

    import sympy
    from math_verify import parse, verify

    from trapo.algorithm.rewards.answers import exact_number

    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    parsed, values = {}, {}

    def parse_cached(answer):
        if answer not in parsed:
            parsed[answer] = parse("\\boxed{" + answer + "}", parsing_timeout=internal_timeout)
        return parsed[answer]

    def value(answer):
        if answer not in values:
            out = None
            if not any(tag in answer for tag in ("%", "circ", "degree", "text", "mathrm", "mbox")):
                exact = exact_number(answer)
                if exact is not None:
                    out = complex(float(exact))
                else:
                    items = parse_cached(answer)
                    expr = items[0] if items else None
                    if isinstance(expr, sympy.Expr) and all(
                        isinstance(x, sympy.Symbol) and len(x.name) == 1 for x in expr.free_symbols
                    ):
                        probe = {x: 0.6180339887 + 0.7071067812 * (ord(x.name) % 29) for x in expr.free_symbols}
                        try:
                            out = complex(expr.evalf(15, subs=probe))
                        except (TypeError, ValueError, OverflowError, ZeroDivisionError):
                            out = None
                        if out is not None and not cmath.isfinite(out):
                            out = None
            values[answer] = out
        return values[answer]

    def equal(gold, pred):
        vg, vp = value(gold), value(pred)
        if vg is not None and vp is not None and abs(vg - vp) > 1e-4 * max(1.0, abs(vg), abs(vp)):
            return False
        return bool(verify(parse_cached(gold), parse_cached(pred), timeout_seconds=internal_timeout))

    for warm in ("1", "\\frac{1}{2}", "x^2+1", "(1,2)", "[1,2)", "\\{1,2\\}", "1+2i", "x=1", "\\text{A}"):
        equal(warm, warm)
    parsed.clear()
    values.clear()
    stdout.write("ready\n")
    stdout.flush()
    stdin = sys.stdin.buffer
    while header := stdin.read(4):
        for gold, pred in pickle.loads(stdin.read(struct.unpack(">I", header)[0])):
            try:
                ok = equal(gold, pred)
            except Exception:  # noqa: BLE001
                ok = False
            stdout.write("1\n" if ok else "0\n")
            stdout.flush()


class LegacyVerifier:
    """Today's pool: one deadline per comparison; an overrun kills the worker, and a fresh one (a new
    Math-Verify import) takes the pairs still queued on it."""

    def __init__(self, num_workers: int, timeout: float):
        self.timeout = timeout
        self.workers = [self._spawn() for _ in range(num_workers)]
        for w in self.workers:
            self._wait_ready(w)

    def _spawn(self):
        internal = str(max(1, int(self.timeout) - 1))
        cmd = [sys.executable, os.path.abspath(__file__), "--legacy-worker", internal]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=runtime.subprocess_env())
        return {"proc": proc, "buffer": b"", "pending": [], "deadline": 0.0}

    @staticmethod
    def _lines(w):
        data = os.read(w["proc"].stdout.fileno(), 1 << 16)
        if not data:
            return None
        *lines, w["buffer"] = (w["buffer"] + data).split(b"\n")
        return lines

    def _wait_ready(self, w):
        """Block until the worker has imported Math-Verify."""
        while True:
            lines = self._lines(w)
            if lines is None:
                raise RuntimeError("legacy worker exited at start-up")
            if b"ready" in lines:
                return

    def _dispatch(self, w, pairs, indices):
        w["pending"] = list(indices)
        if indices:
            payload = pickle.dumps([pairs[i] for i in indices])
            w["proc"].stdin.write(struct.pack(">I", len(payload)) + payload)
            w["proc"].stdin.flush()
            w["deadline"] = time.monotonic() + self.timeout

    def equal_many(self, pairs):
        unique = list(dict.fromkeys(pairs))
        groups = {}
        for i, (gold, _) in enumerate(unique):
            groups.setdefault(gold, []).append(i)
        todo = [[] for _ in self.workers]
        for members in sorted(groups.values(), key=len, reverse=True):
            min(todo, key=len).extend(members)
        results = [False] * len(unique)
        for w, indices in zip(self.workers, todo):
            self._dispatch(w, unique, indices)
        while busy := [w for w in self.workers if w["pending"]]:
            wait = max(0.0, min(w["deadline"] for w in busy) - time.monotonic())
            readable = select.select([w["proc"].stdout for w in busy], [], [], wait)[0]
            for w in busy:
                if w["proc"].stdout in readable:
                    for line in self._lines(w) or []:
                        results[w["pending"].pop(0)] = line == b"1"
                    w["deadline"] = time.monotonic() + self.timeout
                elif time.monotonic() >= w["deadline"] and not select.select([w["proc"].stdout], [], [], 0)[0]:
                    # timed out: kill it, score the pair not equal, resend the rest to a fresh worker
                    w["proc"].kill()
                    w["proc"].wait()
                    rest = w["pending"][1:]
                    fresh = self._spawn()
                    self.workers[self.workers.index(w)] = fresh
                    if rest:
                        self._wait_ready(fresh)
                        self._dispatch(fresh, unique, rest)
        table = dict(zip(unique, results))
        return [table[p] for p in pairs]

    def close(self):
        for w in self.workers:
            w["proc"].kill()
            w["proc"].wait()


def legacy_vote(answers, verifier: LegacyVerifier):
    """Today's `majority_votes` for one question: each distinct answer compared with every cluster."""
    keys = [normalize(a) if a is not None and a.strip() and len(a) <= MAX_ANSWER_CHARS else None for a in answers]
    counts = Counter(k for k in keys if k is not None)
    order = sorted(counts, key=lambda k: (-counts[k], keys.index(k)))
    raw = {k: answers[keys.index(k)] for k in order}
    clusters = []
    for key in order:
        pairs = [(raw[c[0]], raw[key]) for c in clusters]
        fast = [fast_verdict(g, p) for g, p in pairs]
        slow = iter(verifier.equal_many([p for p, f in zip(pairs, fast) if f is None]))
        hits = [next(slow) if f is None else f for f in fast]
        home = next((c for c, hit in zip(clusters, hits) if hit), None)
        if home is None:
            clusters.append([key])
        else:
            home.append(key)
    sizes = [sum(counts[k] for k in c) for c in clusters]
    if not sizes or sizes.count(max(sizes)) > 1:
        return None, [False] * len(answers)
    winner = clusters[sizes.index(max(sizes))]
    return raw[winner[0]], [k in winner for k in keys]


# ----------------------------------------------------------------------------- mixed degenerate answers


def degenerate_answers(seed: int, n: int = 64) -> list[str]:
    """n answers a collapsed policy might give, four kinds in turn; a quarter repeat an earlier one."""
    rng = random.Random(seed)
    digits = lambda k: "".join(rng.choice("0123456789") for _ in range(k))  # noqa: E731
    garbage = ["\\left(", "\\right)", "\\sqrt[", "]{", "}", "\\int", "_{", "^{", "\\sum", "x", "\\cdot", "\\frac{"]
    garbage += ["\\\\", "&", "\\begin{matrix}", "\\end{matrix}", "\\infty", "!", "\\binom{"]
    out: list[str] = []
    for i in range(n):
        if out and rng.random() < 0.25:
            out.append(rng.choice(out))
        elif i % 4 == 0:  # a long digit string, half of them raised to a long power
            number = digits(rng.randint(40, 300))
            out.append(number if rng.random() < 0.5 else f"{number[:20]}^{{{number[20:40]}}}")
        elif i % 4 == 1:  # nested fractions
            inner = "x"
            for _ in range(rng.randint(4, 20)):
                inner = f"\\frac{{{rng.randint(1, 9)}+{inner}}}{{{rng.randint(1, 9)}-y}}"
            out.append(inner)
        elif i % 4 == 2:  # LaTeX garbage
            out.append(" ".join(rng.choice(garbage) for _ in range(rng.randint(10, 60))))
        else:  # an exponent tower
            a, b, c, d = (rng.randint(2, 9) for _ in range(4))
            out.append(f"{a}^{{{b}^{{{c}^{{{d + 3}}}}}}}")
    return out


def collapse_mix(seed: int = 0) -> list[str]:
    """64 answers: 6 code-injection strings; 18 heavy ones (exponent towers, factorials of huge numbers,
    100,000-character digit strings, 5,000-deep braces, a 60x60 matrix); 28 broken LaTeX and odd unicode;
    12 fuzz strings of LaTeX tokens; shuffled."""
    rng = random.Random(seed)
    injection = ["__import__('os').system('id')", 'eval("1+1")', "'; DROP TABLE answers; --", "{{7*7}}"]
    injection += ["\\input{/etc/passwd}", "\\immediate\\write18{rm -rf /}"]
    matrix = "\\\\".join("&".join(str(rng.randint(0, 9)) for _ in range(60)) for _ in range(60))
    heavy = ["9^{9^{9^{9}}}", "2^{2^{2^{2^{2^{2}}}}}", "10^{10^{10^{10}}}", "7^{7^{7^{7}}}", "3^{9^{2^{11}}}"]
    heavy += ["(10^{100})!", "(10^{10})!", "99999999!", "(2^{64})!!", "((10^6)!)!", "\\left(10^{20}\\right)!"]
    heavy += ["(9^{9^9})!", "\\Gamma(10^{30})", "91417776317066907439^{15000806360837783533}"]
    heavy += ["1" + "0" * 100_000, "".join(rng.choice("0123456789") for _ in range(100_000))]
    heavy += ["{" * 5000 + "1" + "}" * 5000, "\\begin{pmatrix}" + matrix + "\\end{pmatrix}"]
    broken = ["\\frac{1}{", "\\sqrt[", "}{", "x^{", "\\left(\\right", "\\frac{\\frac{}{}}{}", "\\begin{matrix}"]
    broken += ["∞", "√2", "½", "𝟙𝟚", "\u200b", "\u202eevil", "①②", "２３", "🙂", "x²+y²", "∑_{i}", "α+β", "ℵ_0"]
    broken += ["\\\\\\\\", "^^^", "_{_{_}}", "\\end{align}", "$$", "1,,2", "\\frac12}", "{{{"]
    tokens = ["\\left(", "\\right)", "\\sqrt[", "]{", "}", "\\int", "_{", "^{", "\\sum", "x", "\\cdot", "\\frac{"]
    tokens += ["\\\\", "&", "\\begin{matrix}", "\\end{matrix}", "\\infty", "!", "\\binom{", "\\prod", "e", "\\pi"]
    fuzz = [" ".join(rng.choice(tokens) for _ in range(rng.randint(10, 60))) for _ in range(12)]
    answers = injection + heavy + broken + fuzz
    rng.shuffle(answers)
    return answers


def timed(side: str, answers: list[str], timeout: float, workers: int) -> tuple[float, Tally]:
    """Seconds of one side on a fresh verifier (started and warmed before the clock): "vote", the majority
    vote over `answers`; "grading", each answer against MIXED_GOLD."""
    verifier = MathVerifier(num_workers=workers, timeout=timeout)
    verifier.start()
    answer_rewards(["1"], ["1"], verifier, timeout)  # Math-Verify imported in the workers: start-up excluded
    tally = Tally()
    t0 = time.perf_counter()
    if side == "vote":
        majority_votes([answers], verifier, timeout, tally=tally)
    else:
        answer_rewards(answers, [MIXED_GOLD] * len(answers), verifier, timeout, tally=tally)
    seconds = time.perf_counter() - t0
    verifier.close()
    return seconds, tally


def mixed(
    timeout: float, workers: int, seeds: int = 3, build=degenerate_answers, what: str = "mixed degenerate answers"
) -> tuple[list[str], float, int]:
    """The vote over mixed degenerate answers (`build(seed)`) beside grading them one by one: its printed lines,
    the worst ratio of the vote's time to the grading's, the most timeouts a vote counted."""
    lines = [
        f"vote over 64 {what} vs grading them one by one against a gold "
        f"({timeout:g} s timeout, {workers} workers, fresh verifiers; target vote/grading <= {MIXED_TARGET})"
    ]
    print(lines[0], flush=True)
    ratios, most = [], 0
    for seed in range(seeds):
        answers = build(seed)
        order = ("vote", "grading") if seed % 2 else ("grading", "vote")  # alternate who runs first
        results = {side: timed(side, answers, timeout, workers) for side in order}
        (vote_s, vote_tally), (grade_s, grade_tally) = results["vote"], results["grading"]
        ratios.append(vote_s / grade_s)
        most = max(most, vote_tally.timeouts)
        line = (
            f"  set {seed}: {len(set(answers))} distinct; vote {vote_s:6.2f} s ({vote_tally.timeouts} timeouts), "
            f"grading {grade_s:6.2f} s ({grade_tally.timeouts} timeouts): {ratios[-1]:.2f}x"
        )
        print(line, flush=True)
        lines.append(line)
    lines.append(f"  worst {max(ratios):.2f}x (target <= {MIXED_TARGET}); most timeouts in a vote: {most}")
    print(lines[-1], flush=True)
    return lines, max(ratios), most


# ----------------------------------------------------------------------------- the run


def towers(t: float, workers: int) -> tuple[list[str], bool]:
    """The vote over 8 answers that each exhaust the timeout, ours beside the previous loop: lines, met."""
    lines = [
        f"majority vote over {len(ANSWERS)} distinct answers that each exhaust the {t:g} s Math-Verify timeout "
        f"({workers} workers), e.g. {ANSWERS[0]!r}"
    ]
    print(lines[0], flush=True)
    verifier = MathVerifier(num_workers=workers, timeout=t)
    verifier.start()
    tally = Tally()
    t0 = time.perf_counter()
    ours = majority_votes([ANSWERS], verifier, t, tally=tally)[0]
    ours_s = time.perf_counter() - t0
    verifier.close()
    lines.append(
        f"  ours    : {ours_s:7.2f} s = {ours_s / t:5.2f} x timeout  (target <= {TARGET_RATIO} x)  "
        f"timeouts counted: {tally.timeouts}"
    )
    print(lines[-1], flush=True)
    legacy = LegacyVerifier(workers, t)
    t0 = time.perf_counter()
    today = legacy_vote(ANSWERS, legacy)
    today_s = time.perf_counter() - t0
    legacy.close()
    lines.append(
        f"  before  : {today_s:7.2f} s = {today_s / t:5.2f} x timeout  (every comparison waits out the timeout)"
    )
    lines.append(f"  speed-up {today_s / ours_s:.1f}x; same outcome: {ours == today} (pseudo-label: {ours[0]})")
    print("\n".join(lines[-2:]), flush=True)
    return lines, ours == today and ours_s <= TARGET_RATIO * t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per comparison, the towers' vote")
    parser.add_argument("--mixed-timeout", type=float, default=2.0, help="seconds per comparison, the mixed vote")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md as it is")
    args = parser.parse_args()
    logging.getLogger("trapo.engine.grading.verifier").setLevel(logging.ERROR)  # the timeouts are the point: counted
    tower_lines, towers_met = towers(args.timeout, args.workers)
    mixed_lines, worst, _ = mixed(args.mixed_timeout, args.workers)
    kinds = "answers of four kinds (code injection, heavy, broken LaTeX and unicode, LaTeX fuzz)"
    collapse_lines, collapse_worst, collapse_most = mixed(args.mixed_timeout, args.workers, 2, collapse_mix, kinds)
    collapse_lines[-1] += f" (target <= {COLLAPSE_TIMEOUTS})"
    out = ROOT / "outputs/bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "vote.txt").write_text("\n".join(tower_lines + mixed_lines + collapse_lines) + "\n")
    if not args.no_docs:
        from trapo.commands import readme

        path = readme.BLOCKS["bench-vote"]
        path.write_text(readme.replace_block(path.read_text(), "bench-vote", readme.fenced_block("bench-vote", out)))
        print(f"bench_vote: wrote the bench-vote block of {path.relative_to(ROOT)}")
    met = towers_met and max(worst, collapse_worst) <= MIXED_TARGET and collapse_most <= COLLAPSE_TIMEOUTS
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--legacy-worker"]:
        legacy_worker(int(sys.argv[2]))
    else:
        main()
