"""Math-Verify with a hard per-comparison deadline, usable from any thread.

Math-Verify's own timeout uses SIGALRM, which only works in the main
thread, and cannot interrupt a long C-level computation (huge integer
powers) at all. So comparisons run in persistent worker processes
(`trapo.rewards.verify_worker`); the parent waits for each answer with a
deadline and, when one overruns, kills that worker, scores the pair as not
equal and starts a fresh worker for the rest. The parent side is plain
pipes and `select`, so it works from a worker thread or process too.

Unique pairs are spread over the workers grouped by gold string (so each
worker's parse cache sees the same golds again).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class _Worker:
    """One verify_worker child process and the bookkeeping of its current request."""

    def __init__(self, internal_timeout: int):
        env = dict(os.environ, OMP_NUM_THREADS="1", TRAPO_MV_INTERNAL_TIMEOUT=str(internal_timeout))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trapo.rewards.verify_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.fd = self.proc.stdout.fileno()
        self.ready = False
        self.buffer = b""
        self.pending: deque[int] = deque()  # indices of pairs sent and not yet answered
        self.deadline = 0.0

    def send(self, pairs: list[tuple[str, str]]) -> None:
        payload = pickle.dumps(pairs)
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
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class MathVerifier:
    """Pool of Math-Verify workers: `equal_many(pairs, timeout)` -> list of bools.

    timeout: seconds one comparison may take (default 5); startup_timeout:
    seconds a new worker may take to import Math-Verify. A worker that
    cannot start at all raises RuntimeError (a broken installation); no
    answer content ever raises.
    """

    def __init__(self, num_workers: int = 2, timeout: float = 5.0, startup_timeout: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"MathVerifier: num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.timeouts = 0  # comparisons that ran out of time, since creation
        self._internal_timeout = max(1, int(timeout) - 1)
        self._workers: list[_Worker] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def start(self) -> None:
        """Start the workers now (they start on first use otherwise)."""
        with self._lock:
            self._ensure_workers()
            self._wait_ready(self._workers)

    def close(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child must not kill its parent's workers
        for w in self._workers:
            w.kill()
        self._workers = []

    def _ensure_workers(self) -> None:
        if os.getpid() != self._pid:  # forked: the pipes belong to the parent
            self._workers, self._pid = [], os.getpid()
        self._workers = [w for w in self._workers if w.proc.poll() is None]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._internal_timeout))

    def _wait_ready(self, workers: list[_Worker]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        for w in workers:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([w.fd], [], [], left)[0]:
                    w.kill()
                    raise RuntimeError(f"Math-Verify worker did not start within {self.startup_timeout:.0f} s")
                lines = w.read_lines()
                if lines is None:
                    w.kill()
                    raise RuntimeError(
                        "Math-Verify worker exited at start-up (is math-verify installed? "
                        f"try: {sys.executable} -m trapo.rewards.verify_worker)"
                    )
                w.ready = any(line == b"ready" for line in lines)

    def equal_many(self, pairs: Sequence[tuple[str, str]], timeout: float | None = None) -> list[bool]:
        """Math-Verify equivalence verify(parse(gold), parse(pred)) for each (gold, pred)."""
        timeout = self.timeout if timeout is None else timeout
        unique = list(dict.fromkeys(pairs))
        if not unique:
            return []
        with self._lock:
            results = self._run(unique, timeout)
        table = dict(zip(unique, results))
        return [table[p] for p in pairs]

    def _run(self, pairs: list[tuple[str, str]], timeout: float) -> list[bool]:
        self._ensure_workers()
        self._wait_ready(self._workers)
        # Spread pairs over workers, whole gold groups at a time, largest first.
        groups: dict[str, list[int]] = {}
        for i, (gold, _) in enumerate(pairs):
            groups.setdefault(gold, []).append(i)
        todo: list[list[int]] = [[] for _ in self._workers]
        for members in sorted(groups.values(), key=len, reverse=True):
            min(todo, key=len).extend(members)

        results: list[bool | None] = [None] * len(pairs)

        def dispatch(slot: int, indices: list[int]) -> None:
            w = self._workers[slot]
            if not indices:
                return
            w.pending = deque(indices)
            w.send([pairs[i] for i in indices])
            w.deadline = time.monotonic() + timeout

        def replace(slot: int) -> None:
            """Kill a worker, score its current pair False, resend the rest to a new one."""
            old = self._workers[slot]
            old.kill()
            results[old.pending.popleft()] = False
            new = _Worker(self._internal_timeout)
            self._workers[slot] = new
            if old.pending:  # otherwise it imports in the background, ready for the next call
                self._wait_ready([new])
                dispatch(slot, list(old.pending))

        for slot, indices in enumerate(todo):
            dispatch(slot, indices)
        while True:
            busy = [s for s, w in enumerate(self._workers) if w.pending]
            if not busy:
                break
            now = time.monotonic()
            wait = max(0.0, min(self._workers[s].deadline for s in busy) - now)
            readable = select.select([self._workers[s].fd for s in busy], [], [], wait)[0]
            for slot in busy:
                w = self._workers[slot]
                if w.fd in readable:
                    lines = w.read_lines()
                    if lines is None:  # the worker died (out of memory, say)
                        log.warning("Math-Verify worker exited mid-request; scoring its pair as not equal")
                        replace(slot)
                        continue
                    for line in lines:
                        results[w.pending.popleft()] = line == b"1"
                    w.deadline = time.monotonic() + timeout
                elif time.monotonic() >= w.deadline and not select.select([w.fd], [], [], 0)[0]:
                    # (the zero-wait select: answers that arrived while another
                    # worker was being restarted are not timeouts)
                    self.timeouts += 1
                    gold, pred = pairs[w.pending[0]]
                    log.warning(
                        "Math-Verify comparison exceeded %.1f s; scored as not equal (gold %.60r, pred %.60r)",
                        timeout,
                        gold,
                        pred,
                    )
                    replace(slot)
        return [bool(r) for r in results]


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
