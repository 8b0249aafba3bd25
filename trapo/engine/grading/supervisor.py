"""The Math-Verify supervisor: the process that runs comparisons in forked executors.

Started by `trapo.engine.grading.verifier.MathVerifier` as
`python -m trapo.engine.grading.supervisor WORKERS MAX_WORKERS [SPEC]` (SPEC: `reward.verifier`;
a task verifier's calls take Math-Verify's place in the executors, under the same rules: `verifiers`). The supervisor
imports and warms up Math-Verify once, then forks its executors from itself
(a few milliseconds each, already warm). After the warm-up it never runs
sympy, so it stays responsive and enforces every deadline itself:

- each item (one comparison, or one answer to parse) runs in an executor
  under a soft alarm (SIGALRM at 90% of its time: interrupts Python-level
  sympy work and keeps the executor and its parse cache) and a hard deadline
  (the executor is killed: C code that runs long without checking for
  signals, one product of two huge integers say, never sees the alarm);
- executors mark their progress (parsing the gold, the pred, comparing) in
  a shared byte, so a timeout is blamed on the answer being parsed, or on
  the pair when both were parsed;
- what exhausted a timeout is remembered and answered at once next time, at
  that timeout or a shorter one, whichever executor would have got it;
- hedging: when an item runs past `patience` with items queued behind it,
  spare executors are forked (up to MAX_WORKERS), so that many slow answers
  time out side by side, in about one timeout, not one after another;
- a deadline (the step's grading budget) cuts running items and starts no
  new ones;
- an executor that dies on an item (the out-of-memory killer's first pick
  when sympy blows up) is replaced and the item runs once more on the fresh
  one; only a second death settles it, as f (failed: undecided). A death
  is no timeout: nothing is remembered for it.

The wire, both ways: `protocol`. The executors' side (Math-Verify, its
parse cache, the numeric pre-filter, the soft alarm): `executor`.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import select
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from trapo import faults
from trapo.engine.grading.executor import _Checker, _executor_main
from trapo.engine.grading.protocol import _read_message, _write_message

_CACHE_LIMIT = 50_000  # parsed answers an executor keeps before starting afresh
_MEMORY_LIMIT = 10_000  # remembered slow answers and pairs
_SOFT = 0.9  # the soft alarm rings at this fraction of an item's time
_MISS_COST = 2  # placing a unit: an answer not yet parsed there weighs as much as two queued items

log = logging.getLogger("trapo.engine.grading.supervisor")  # by name: run as __main__


def patience(timeout: float) -> float:
    """Seconds an item may run before spares are forked for the items queued behind it.

    Well above a normal comparison (milliseconds; a slow sympy simplify, a
    fraction of a second) so spares are rare in normal grading, and a tenth of
    the timeout so that slow answers still start close together.
    """
    return min(0.5, max(0.05, timeout / 10))


@dataclass(eq=False)
class _Executor:
    pid: int
    to_fd: int
    from_fd: int
    spare: bool  # forked for hedging, retired at the end of the request
    shared: mmap.mmap  # one byte, shared with the executor: the running item's phase
    buffer: bytes = b""
    queue: deque = field(default_factory=deque)  # item indices placed here, not yet started
    cached: set = field(default_factory=set)  # answers it has parsed (mirror of its cache)
    item: int | None = None  # the running item
    started: float = 0.0
    hard_at: float = 0.0
    cut_by_deadline: bool = False  # its time was shortened to the request's deadline

    @property
    def phase(self) -> str:
        """What the running item is doing: g parsing the gold, p parsing the pred, v comparing."""
        return chr(self.shared[0])


class _Request:
    """One request's items and the results sent back so far."""

    def __init__(self, items, timeout: float, deadline: float | None, emit):
        self.items, self.timeout, self.deadline, self.emit = items, timeout, deadline, emit
        self.settled = [False] * len(items)
        self.left = len(items)
        self.deaths: dict[int, int] = {}  # item -> executors that died running it
        self.memory_seen = -1  # Supervisor.memory_changes when its queues were last checked against memory

    def settle(self, index: int, code: str) -> None:
        if not self.settled[index]:
            self.settled[index] = True
            self.left -= 1
            self.emit(index, code)


def remember(memory: dict, key, timeout: float) -> None:
    """Remember that `key` exhausted `timeout` (the longest such timeout kept; the oldest entry dropped past
    _MEMORY_LIMIT). The parent's mirror (`MathVerifier._mirror`) calls it too, so both evict alike."""
    memory[key] = max(timeout, memory.pop(key, 0.0))
    if len(memory) > _MEMORY_LIMIT:
        memory.pop(next(iter(memory)))


def _unqueue(queue: deque, i: int) -> None:
    """Remove `i`, cheaply at either end (where it almost always is)."""
    if queue[0] == i:
        queue.popleft()
    elif queue[-1] == i:
        queue.pop()
    else:
        queue.remove(i)


class Supervisor:
    """Places, runs, hedges and times the items of one request after another."""

    def __init__(self, workers: int, max_workers: int, make_checker=None):
        self.make_checker = make_checker  # a task verifier's (`verifiers.TaskChecker`); None: Math-Verify
        self.workers = workers
        self.max_workers = max(workers, max_workers)
        self.executors: list[_Executor] = []
        self.slow_answers: dict[str, float] = {}  # answer -> the longest timeout its parsing exhausted
        self.slow_pairs: dict[tuple[str, str], float] = {}
        self.memory_changes = 0

    # -- processes

    def _fork(self, spare: bool) -> _Executor:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        shared = mmap.mmap(-1, 1)  # anonymous and shared: stays common to both sides of the fork
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _executor_main(down_r, up_w, shared, me, self.make_checker)
            except BaseException:  # noqa: BLE001 - an executor never returns into the supervisor's code
                code = 1
            os._exit(code)
        os.close(down_r)
        os.close(up_w)
        return _Executor(pid, down_w, up_r, spare, shared)

    @staticmethod
    def _end(ex: _Executor) -> None:
        try:
            os.kill(ex.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(ex.pid, 0)
        os.close(ex.to_fd)
        os.close(ex.from_fd)
        ex.shared.close()

    def _respawn(self, ex: _Executor) -> None:
        """Replace the process behind `ex` (it keeps its queue), or drop `ex` if it was a spare."""
        self._end(ex)
        if ex.spare:
            self.executors.remove(ex)
            return
        fresh = self._fork(spare=False)
        ex.pid, ex.to_fd, ex.from_fd, ex.shared = fresh.pid, fresh.to_fd, fresh.from_fd, fresh.shared
        ex.buffer, ex.item, ex.cached = b"", None, set()

    def _ensure_base(self) -> None:
        for ex in [e for e in self.executors if not e.spare]:
            if os.waitpid(ex.pid, os.WNOHANG) != (0, 0):  # died while idle (out of memory, say)
                self.executors.remove(ex)
                os.close(ex.to_fd)
                os.close(ex.from_fd)
                ex.shared.close()
        while sum(not e.spare for e in self.executors) < self.workers:
            self.executors.append(self._fork(spare=False))

    def shutdown(self) -> None:
        for ex in self.executors:
            self._end(ex)
        self.executors = []

    # -- memory of what exhausted a timeout

    def _remembered(self, item, timeout: float) -> str | None:
        gold, pred = item
        if self.slow_answers.get(gold, -1.0) >= timeout:
            return "g"
        if pred is not None and self.slow_answers.get(pred, -1.0) >= timeout:
            return "p"
        if pred is not None and self.slow_pairs.get((gold, pred), -1.0) >= timeout:
            return "t"
        return None

    def _blame(self, req: _Request, ex: _Executor) -> str:
        """The code for `ex`'s item, which ran out of time in phase `ex.phase`, with a '*': the answer (or the
        pair) it blames is remembered now, so the parent can mirror the memory (`MathVerifier.memory`)."""
        gold, pred = req.items[ex.item]
        if ex.cut_by_deadline:
            return "b"
        self.memory_changes += 1
        if ex.phase == "g" or pred is None:
            remember(self.slow_answers, gold, req.timeout)
            return "g*"
        if ex.phase == "p":
            remember(self.slow_answers, pred, req.timeout)
            return "p*"
        remember(self.slow_pairs, (gold, pred), req.timeout)
        return "t*"

    # -- one request

    def run(self, items, units, timeout: float, deadline: float | None, emit) -> None:
        req = _Request(items, timeout, deadline, emit)
        self._ensure_base()
        # an answer parsed already is ready; a task verifier's one-answer items (extractions) return data: run them
        parsed = set().union(*(ex.cached for ex in self.executors)) if self.make_checker is None else set()
        for i, item in enumerate(items):
            code = self._remembered(item, timeout) or ("r" if item[1] is None and item[0] in parsed else None)
            if code:
                req.settle(i, code)
        self._place(req, units)
        wait_s = patience(timeout)
        try:
            while req.left:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    for ex in self.executors:
                        while ex.queue:
                            req.settle(ex.queue.popleft(), "b")
                for ex in list(self.executors):
                    # (the zero-wait select: an answer that came in just now is no timeout)
                    if ex.item is not None and now >= ex.hard_at and not select.select([ex.from_fd], [], [], 0)[0]:
                        self._overrun(req, ex, "ran out of time")
                self._dispatch(req, wait_s, now)
                self._hedge(req, wait_s, now)
                if req.left:
                    self._wait(req, wait_s, now)
        finally:
            for ex in [e for e in self.executors if e.spare]:
                self._end(ex)
                self.executors.remove(ex)

    def _place(self, req: _Request, units) -> None:
        """Queue each unit on the base executor where it costs least: queued items plus answers to parse."""
        groups: dict[int, list[int]] = {}
        for i, unit in enumerate(units):
            if not req.settled[i]:
                groups.setdefault(unit, []).append(i)
        base = [ex for ex in self.executors if not ex.spare]
        for members in sorted(groups.values(), key=len, reverse=True):
            answers = {s for i in members for s in req.items[i] if s is not None}
            home = min(base, key=lambda ex: len(ex.queue) + _MISS_COST * len(answers - ex.cached))
            home.queue.extend(members)

    def _suspects(self, req: _Request, wait_s: float, now: float) -> set[str]:
        """Answers being parsed for longer than `wait_s`: other items with them wait, not hang beside them."""
        out = set()
        for ex in self.executors:
            if ex.item is not None and now - ex.started >= wait_s and ex.phase in ("g", "p"):
                gold, pred = req.items[ex.item]
                out.add(gold if ex.phase == "g" or pred is None else pred)
        return out

    @staticmethod
    def _free(req: _Request, i: int, suspects: set[str]) -> bool:
        return not suspects or suspects.isdisjoint(s for s in req.items[i] if s is not None)

    def _take(self, req: _Request, ex: _Executor, suspects: set[str], wait_s: float, now: float) -> int | None:
        """The next item for idle `ex`: its own queue, else one stolen from a slow or a long queue."""
        slow = [o for o in self.executors if o.item is not None and now - o.started >= wait_s and o.queue]
        sources = [(ex.queue, False)] + [(o.queue, False) for o in slow]
        longest = max((o for o in self.executors if o is not ex), key=lambda o: len(o.queue), default=None)
        if longest is not None and len(longest.queue) >= 2:
            sources.append((longest.queue, True))  # from the tail: its owner keeps what comes next
        for queue, from_tail in sources:
            for i in reversed(queue) if from_tail else queue:
                if self._free(req, i, suspects):
                    _unqueue(queue, i)
                    return i
        return None

    def _dispatch(self, req: _Request, wait_s: float, now: float) -> None:
        if req.memory_seen != self.memory_changes:  # something newly exhausted a timeout: settle its items
            req.memory_seen = self.memory_changes
            for ex in self.executors:
                for i in [i for i in ex.queue if self._remembered(req.items[i], req.timeout)]:
                    ex.queue.remove(i)
                    req.settle(i, self._remembered(req.items[i], req.timeout))
        suspects = self._suspects(req, wait_s, now)
        for ex in list(self.executors):
            while ex.item is None and ex in self.executors:
                i = self._take(req, ex, suspects, wait_s, now)
                if i is None:
                    break
                self._start(req, ex, i, now)

    def _start(self, req: _Request, ex: _Executor, i: int, now: float) -> None:
        limit, ex.cut_by_deadline = req.timeout, False
        if req.deadline is not None and req.deadline - now < limit:
            limit, ex.cut_by_deadline = req.deadline - now, True
        if limit <= 0:
            req.settle(i, "b")
            return
        clear = len(ex.cached) > _CACHE_LIMIT
        if clear:
            ex.cached = set()
        gold, pred = req.items[i]
        ex.shared[0] = ord("g")
        try:
            _write_message(ex.to_fd, (gold, pred, _SOFT * limit, clear))
        except OSError:  # it died while idle: the item goes back to the front, for a fresh executor
            self._respawn(ex)
            self._requeue_first(ex, i)
            return
        ex.item, ex.started, ex.hard_at = i, now, now + limit

    def _hedge(self, req: _Request, wait_s: float, now: float) -> None:
        """Fork spares for the items queued behind slow executors that idle ones cannot take."""
        suspects = self._suspects(req, wait_s, now)
        behind = sum(
            self._free(req, i, suspects)
            for ex in self.executors
            if ex.item is not None and now - ex.started >= wait_s
            for i in ex.queue
        )
        idle = sum(ex.item is None for ex in self.executors)
        extra = min(behind - idle, self.max_workers - len(self.executors))
        if extra > 0:
            self.executors += [self._fork(spare=True) for _ in range(extra)]
            self._dispatch(req, wait_s, now)

    def _wait(self, req: _Request, wait_s: float, now: float) -> None:
        busy = [ex for ex in self.executors if ex.item is not None]
        if not busy:
            raise RuntimeError("grading supervisor: items left but nothing running")  # a scheduling bug
        events = [ex.hard_at for ex in busy]
        events += [ex.started + wait_s for ex in busy if now - ex.started < wait_s]
        if req.deadline is not None:
            events.append(req.deadline)
        readable = select.select([ex.from_fd for ex in busy], [], [], max(0.0, min(events) - now))[0]
        for ex in busy:
            if ex.from_fd not in readable:
                continue
            gold, pred = req.items[ex.item]
            ex.cached.update(s for s, done in ((gold, ex.phase != "g"), (pred, ex.phase == "v")) if done)
            data = os.read(ex.from_fd, 4096)
            if not data:
                self._died(req, ex)
                continue
            ex.buffer += data
            *lines, ex.buffer = ex.buffer.split(b"\n")
            for line in lines:
                self._progress(req, ex, line.decode())

    def _progress(self, req: _Request, ex: _Executor, line: str) -> None:
        """The result line of `ex`'s item."""
        req.settle(ex.item, self._blame(req, ex) if line == "t" else line)
        ex.item = None

    def _died(self, req: _Request, ex: _Executor) -> None:
        """`ex` exited while running its item (killed: out of memory, say). No timeout: the item goes back to
        the front of a queue for a fresh executor, once; a second death settles it as failed (f)."""
        i = ex.item
        req.deaths[i] = req.deaths.get(i, 0) + 1
        log.debug("executor died in phase %s (death %d of item %d)", ex.phase, req.deaths[i], i)
        self._respawn(ex)
        if req.deaths[i] >= 2:
            req.settle(i, "f")
            return
        self._requeue_first(ex, i)

    def _requeue_first(self, ex: _Executor, i: int) -> None:
        """Item `i` back at the front of `ex`'s queue (`ex` just respawned), or of a base executor's when `ex`
        was a spare (respawning a spare retires it)."""
        home = next(e for e in self.executors if not e.spare) if ex.spare else ex
        home.queue.appendleft(i)

    def _overrun(self, req: _Request, ex: _Executor, what: str) -> None:
        """`ex` passed its hard deadline or died: settle its item as timed out and replace it."""
        code = self._blame(req, ex)
        if code != "b":
            gold, pred = req.items[ex.item]
            log.debug("executor %s in phase %s (gold %.60r, pred %.60r)", what, ex.phase, gold, pred)
        req.settle(ex.item, code)
        self._respawn(ex)

    # -- the protocol

    def serve(self, stdin, stdout) -> None:
        def emit(index: int, code: str) -> None:
            stdout.write(f"{index} {code}\n")
            stdout.flush()

        try:
            while True:
                request = _read_message(stdin.fileno())
                if request is None:
                    return  # parent closed the pipe
                if "restore" in request:  # the memory of a supervisor this one replaces, or of a checkpoint
                    self.slow_answers = dict(request["restore"]["answers"])
                    self.slow_pairs = {tuple(k): v for k, v in request["restore"]["pairs"]}
                    self.memory_changes += 1
                    stdout.write("restored\n")
                    stdout.flush()
                    continue
                self.run(request["items"], request["units"], request["timeout"], request["deadline"], emit)
        finally:
            self.shutdown()


def warm_up() -> None:
    """Math-Verify's first parse of each kind of answer pays one-off set-up (its imports, regexes, the LaTeX
    grammar): paid once, before executors are forked (and by a warm parent before it forks supervisors)."""
    warm = _Checker()
    for answer in ("1", "\\frac{1}{2}", "x^2+1", "(1,2)", "[1,2)", "\\{1,2\\}", "1+2i", "x=1", "\\text{A}"):
        warm.equal(answer, answer)


def _serve(workers: int, max_workers: int, spec: str = "math", warm: bool = True) -> None:
    # The trainer decides when grading stops: a preemption signal (SIGTERM, a Ctrl-C, or the deepspeed
    # launcher terminating the whole process tree) lets it finish its step, grading included. This
    # process ends when the trainer closes the pipe or kills it; executors die with it (PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The protocol gets a private copy of stdout; fd 1 then points at stderr,
    # so a stray print() in a library cannot corrupt the stream.
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are reported by the parent

    make_checker = None
    if spec == "math":
        if warm:  # else forked from a warm parent, which paid it
            warm_up()
    else:  # a task verifier (`reward.verifier`): imported once here, its executors fork with it
        from trapo.algorithm.rewards.verifiers import TaskChecker, load_verifier

        verifier = load_verifier(spec)
        make_checker = lambda: TaskChecker(verifier)  # noqa: E731
    if faults.hit("grader_first_start"):  # dies warming up, before "ready", as the out-of-memory killer's pick
        faults.crash()
    gc.collect()
    gc.freeze()  # executors share these pages; the collector would otherwise copy them on its first pass
    supervisor = Supervisor(workers, max_workers, make_checker)
    supervisor._ensure_base()
    stdout.write("ready\n")
    stdout.flush()
    supervisor.serve(sys.stdin.buffer, stdout)


if __name__ == "__main__":
    _serve(
        int(sys.argv[1]) if len(sys.argv) > 1 else 2,
        int(sys.argv[2]) if len(sys.argv) > 2 else 8,
        sys.argv[3] if len(sys.argv) > 3 else "math",
    )
