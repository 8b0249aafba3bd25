"""Math-Verify with a hard per-comparison deadline, usable from any thread.

Math-Verify's own timeout uses SIGALRM, which only works in the main
thread, and cannot interrupt a long C-level computation (huge integer
powers) at all. So comparisons run in another process tree
(`trapo.algorithm.rewards.verify_worker`): one supervisor, which forks executors and
enforces every deadline, including the step's grading budget. The parent
side is plain pipes and `select`, so it works from a worker thread or
process too.

Each comparison comes back as a `Verdict`, so that a timeout (and the answer
it is blamed on) is told apart from a plain "not equal". Unique pairs are
queued on the executors grouped by gold string (so each executor's parse
cache sees the same golds again).
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_PACKAGE_PARENT = Path(__file__).resolve().parents[3]  # trapo/algorithm/rewards/verifier.py -> the repo

_STALL_S = 30.0  # beyond the timeout: a supervisor silent this long is broken (it settles every item in time)


class Verdict(enum.Enum):
    """The outcome of one comparison (or, for `prepare_many`, of parsing one answer)."""

    EQUAL = "1"
    NOT_EQUAL = "0"
    READY = "r"  # prepare_many: parsed, and cached for the comparisons to come
    TIMEOUT = "t"  # both answers parsed, but comparing them ran out of time: blame the pair
    GOLD_TIMEOUT = "g"  # parsing the gold ran out of time, now or at an earlier call
    PRED_TIMEOUT = "p"  # parsing the pred ran out of time, now or at an earlier call
    CUT = "b"  # the grading budget was spent before it was decided

    @property
    def timed_out(self) -> bool:
        return self in (Verdict.TIMEOUT, Verdict.GOLD_TIMEOUT, Verdict.PRED_TIMEOUT)


class _SupervisorProcess:
    """The verify_worker process, as the parent sees it."""

    def __init__(self, num_workers: int, max_workers: int):
        # A fixed hash seed: Math-Verify's verdict on degenerate answers (`0` vs `4 0/0`) follows set and dict
        # order, which would otherwise change from run to run. Executors fork from the supervisor: same seed.
        # (sympy's own random order is reset before each item: verify_executor._run_item.)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        # The worker imports this package: the directory that holds `trapo/` goes first on its path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_PARENT), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trapo.algorithm.rewards.verify_worker", str(num_workers), str(max_workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # Its own session: a Ctrl-C at the terminal reaches the trainer, which finishes its step
            # (grading included) before it stops; the worker ends when the trainer closes its stdin.
            start_new_session=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.ready = False
        self.buffer = b""

    def send(self, request: dict) -> None:
        payload = pickle.dumps(request)
        self.proc.stdin.write(struct.pack(">I", len(payload)) + payload)
        self.proc.stdin.flush()

    def read_lines(self) -> list[bytes] | None:
        """Lines now available; None when the process has closed its output."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return lines

    def kill(self) -> None:
        """Its executors die with it (PR_SET_PDEATHSIG)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class MathVerifier:
    """Math-Verify in a pool of executor processes: `judge_many(pairs, timeout, deadline)` -> Verdicts.

    timeout: seconds one comparison may take (default 5); num_workers:
    executors kept (with their parse caches); max_workers: how many may run
    at once while slow answers are timing out (spares are forked for the
    items queued behind them, and retired after the request); startup_timeout:
    seconds the supervisor may take to import Math-Verify. A supervisor that
    cannot start at all raises RuntimeError (a broken installation); no answer
    content ever raises.
    """

    def __init__(
        self, num_workers: int = 2, timeout: float = 5.0, startup_timeout: float = 120.0, max_workers: int = 8
    ):
        if num_workers < 1:
            raise ValueError(f"MathVerifier: num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.max_workers = max(num_workers, max_workers)
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.timeouts = 0  # comparisons (and answers parsed) that ran out of time, since creation
        self._supervisor: _SupervisorProcess | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def start(self) -> None:
        """Start the supervisor and its executors now (they start on first use otherwise)."""
        with self._lock:
            self._wait_ready(self._ensure(), None)

    def close(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child must not kill its parent's workers
        if self._supervisor is not None:
            self._supervisor.kill()
            self._supervisor = None

    def _ensure(self) -> _SupervisorProcess:
        if os.getpid() != self._pid:  # forked: the pipes belong to the parent
            self._supervisor, self._pid = None, os.getpid()
        if self._supervisor is not None and self._supervisor.proc.poll() is not None:
            self._supervisor.kill()
            self._supervisor = None
        if self._supervisor is None:
            self._supervisor = _SupervisorProcess(self.num_workers, self.max_workers)
        return self._supervisor

    def _wait_ready(self, sup: _SupervisorProcess, deadline: float | None) -> bool:
        """True once it is ready; False if `deadline` comes first (it goes on starting in the background)."""
        give_up = time.monotonic() + self.startup_timeout
        while not sup.ready:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            limit = give_up if deadline is None else min(give_up, deadline)
            if not (limit > now and select.select([sup.fd], [], [], limit - now)[0]):
                if time.monotonic() < give_up:
                    continue  # the deadline came first
                sup.kill()
                self._supervisor = None
                raise RuntimeError(f"Math-Verify worker did not start within {self.startup_timeout:.0f} s")
            lines = sup.read_lines()
            if lines is None:
                sup.kill()
                self._supervisor = None
                raise RuntimeError(
                    "Math-Verify worker exited at start-up (is math-verify installed? "
                    f"try: {sys.executable} -m trapo.algorithm.rewards.verify_worker)"
                )
            sup.ready = any(line == b"ready" for line in lines)
        return True

    def judge_many(
        self, pairs: Sequence[tuple[str, str]], timeout: float | None = None, deadline: float | None = None
    ) -> list[Verdict]:
        """Math-Verify equivalence verify(parse(gold), parse(pred)) for each (gold, pred), as Verdicts.

        deadline: a `time.monotonic()` value; what is not decided by then is CUT (and not started).
        """
        unique = list(dict.fromkeys(pairs))
        if not unique:
            return []
        units: dict[str, int] = {}
        codes = self._request(unique, [units.setdefault(g, len(units)) for g, _ in unique], timeout, deadline)
        table = dict(zip(unique, codes))
        return [table[p] for p in pairs]

    def equal_many(self, pairs: Sequence[tuple[str, str]], timeout: float | None = None) -> list[bool]:
        """`judge_many` as booleans: anything but EQUAL (a timeout included) is False."""
        return [v is Verdict.EQUAL for v in self.judge_many(pairs, timeout)]

    def prepare_many(
        self, groups: Sequence[Sequence[str]], timeout: float | None = None, deadline: float | None = None
    ) -> list[list[Verdict]]:
        """Parse each answer once, ahead of the comparisons among each group's answers.

        Each group goes to one executor, where its comparisons will then find
        all its answers parsed. Per answer: READY, GOLD_TIMEOUT (parsing it
        exhausts the timeout: it is remembered, so no later comparison waits
        on it again) or CUT. The answers of all groups run side by side, so
        many slow ones cost about one timeout together.
        """
        unique: dict[str, int] = {}
        for g, answers in enumerate(groups):
            for a in answers:
                unique.setdefault(a, g)
        codes = dict(zip(unique, self._request([(a, None) for a in unique], list(unique.values()), timeout, deadline)))
        ready = (Verdict.EQUAL, Verdict.NOT_EQUAL, Verdict.READY)  # a parse error is no timeout
        return [[Verdict.READY if codes[a] in ready else codes[a] for a in answers] for answers in groups]

    def _request(self, items: list, units: list[int], timeout: float | None, deadline: float | None) -> list[Verdict]:
        timeout = self.timeout if timeout is None else timeout
        if deadline is not None and time.monotonic() >= deadline:
            return [Verdict.CUT] * len(items)
        with self._lock:
            sup = self._ensure()
            if not self._wait_ready(sup, deadline):
                return [Verdict.CUT] * len(items)  # still importing Math-Verify when the budget ran out
            sup.send({"items": items, "units": units, "timeout": timeout, "deadline": deadline})
            verdicts = [Verdict(c) for c in self._collect(sup, len(items), timeout)]
            slow = [item for item, v in zip(items, verdicts) if v.timed_out]
            self.timeouts += len(slow)
        if slow:
            gold, pred = slow[0]
            first = f"parsing {gold!r:.60}" if pred is None else f"gold {gold!r:.60}, pred {pred!r:.60}"
            log.warning(
                "Math-Verify: %d item(s) exceeded %.1f s; scored as not equal (first: %s)", len(slow), timeout, first
            )
        return verdicts

    def _collect(self, sup: _SupervisorProcess, n: int, timeout: float) -> list[str]:
        """The supervisor's answers; a supervisor that dies or falls silent is killed and what is left times out."""
        codes: list[str | None] = [None] * n
        left, last = n, time.monotonic()
        while left:
            wait = last + timeout + _STALL_S - time.monotonic()
            lines = sup.read_lines() if wait > 0 and select.select([sup.fd], [], [], wait)[0] else None
            if lines is None:
                log.error("Math-Verify supervisor died or stalled; scoring %d comparison(s) as timed out", left)
                sup.kill()
                self._supervisor = None
                return [c or Verdict.TIMEOUT.value for c in codes]
            for line in lines:
                index, code = line.split()
                codes[int(index)] = code.decode()
                left -= 1
            last = time.monotonic()
        return codes


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier (workers: $TRAPO_VERIFY_WORKERS, default min(2, CPUs))."""
    global _default
    with _default_lock:
        if _default is None:
            workers = int(os.environ.get("TRAPO_VERIFY_WORKERS", min(2, os.cpu_count() or 1)))
            _default = MathVerifier(num_workers=workers)
        return _default
