"""Majority vote over degenerate answers: 8 distinct answers that each exhaust the Math-Verify timeout.

The answers are exponent towers 9^{9^{9^{k}}}: evaluating one runs into any
timeout (a collapsed policy emitting garbage, as the paper describes for
unsupervised training, could answer like this). All distinct, so the TTRL
pseudo-label is none (8 singletons). Prints, side by side in one run, the
seconds of one vote and their ratio to the timeout (target: ours <= 2.5 x):

- ours: `majority_votes` on a fresh `MathVerifier` (start-up excluded): the
  answers that need Math-Verify are parsed once, side by side, before any
  comparison; one that exhausts the timeout is frozen, never compared;
- today's: the vote as it was before, reimplemented here: round r compares
  the r-th distinct answer with every cluster, over worker processes that
  wait out each comparison's timeout, then kill the worker and start a fresh
  one (a new Math-Verify import) for the pairs still queued on it.

    PYTHONPATH=. python bench/bench_vote.py [--timeout 5] [--workers 2]
"""

from trapo import runtime

runtime.configure()  # bounded threads before torch or Math-Verify is imported

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import select  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

from trapo.algorithm.rewards import Tally, majority_votes  # noqa: E402
from trapo.algorithm.rewards.answers import MAX_ANSWER_CHARS, normalize  # noqa: E402
from trapo.algorithm.rewards.verifiable import fast_verdict  # noqa: E402
from trapo.algorithm.rewards.verifier import MathVerifier  # noqa: E402

ANSWERS = [f"9^{{9^{{9^{{{k}}}}}}}" for k in range(4, 12)]
TARGET_RATIO = 2.5


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


# ----------------------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per Math-Verify comparison")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    t = args.timeout
    print(
        f"majority vote over {len(ANSWERS)} distinct answers that each exhaust the {t:g} s Math-Verify timeout "
        f"({args.workers} workers), e.g. {ANSWERS[0]!r}"
    )

    logging.getLogger("trapo.algorithm.rewards.verifier").setLevel(logging.ERROR)  # the timeouts are the point: counted
    verifier = MathVerifier(num_workers=args.workers, timeout=t)
    verifier.start()
    tally = Tally()
    t0 = time.perf_counter()
    ours = majority_votes([ANSWERS], t, verifier, tally=tally)[0]
    ours_s = time.perf_counter() - t0
    verifier.close()
    print(
        f"  ours    : {ours_s:7.2f} s = {ours_s / t:5.2f} x timeout  (target <= {TARGET_RATIO} x)  "
        f"timeouts counted: {tally.timeouts}",
        flush=True,
    )

    legacy = LegacyVerifier(args.workers, t)
    t0 = time.perf_counter()
    today = legacy_vote(ANSWERS, legacy)
    today_s = time.perf_counter() - t0
    legacy.close()
    print(f"  today's : {today_s:7.2f} s = {today_s / t:5.2f} x timeout  (every comparison waits out the timeout)")
    print(f"  speed-up {today_s / ours_s:.1f}x; same outcome: {ours == today} (pseudo-label: {ours[0]})")
    sys.exit(0 if ours == today and ours_s <= TARGET_RATIO * t else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--legacy-worker"]:
        legacy_worker(int(sys.argv[2]))
    else:
        main()
