"""Math-Verify with a hard per-comparison deadline, usable from any thread.

Math-Verify's own timeout uses SIGALRM, which only works in the main
thread, and cannot interrupt a long C-level computation (huge integer
powers) at all. So comparisons run in another process tree
(`trapo.engine.grading.supervisor`): one supervisor, which forks executors and
enforces every deadline, including the step's grading budget. The parent
side is plain pipes and `select`, so it works from a worker thread or
process too.

`MathVerifier` is the `Judge` that the reward functions of `trapo.algorithm.rewards` are given.
Each comparison comes back as a `Verdict`, so that a timeout (and the answer
it is blamed on) is told apart from a plain "not equal". Unique pairs are
queued on the executors grouped by gold string (so each executor's parse
cache sees the same golds again).

Graders outlive their processes. An executor that dies mid-item is replaced
and the item re-run once (`supervisor`). A supervisor that dies mid-request
is restarted and sent the items it had not answered, once; restarts back off
(1, 2, 4 s) while a new one fails to start. What still cannot be decided is
FAILED: scored as not equal, counted, and warned about, never a timeout and
never an exception. The first supervisor is retried the same way; only two
failed starts in a row before any supervisor came up raise `GraderStartError`:
a broken installation. What exhausted a timeout is remembered (answered at once next
time); the parent mirrors that memory, hands it to every replacement
supervisor, and a checkpoint keeps it (`memory` / `load_memory`), so rewards
do not change when a process is replaced or a run resumes.
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
from collections.abc import Sequence
from pathlib import Path

from trapo import faults
from trapo.algorithm.rewards.judge import Verdict
from trapo.engine.grading.protocol import decode_value
from trapo.engine.grading.supervisor import remember

log = logging.getLogger(__name__)


_STALL_S = 30.0  # beyond the timeout: a supervisor silent this long is broken (it settles every item in time)
_RESTART_WAITS = (1.0, 2.0, 4.0)  # seconds before each further try to start a replacement supervisor
_PACKAGE_PARENT = Path(__file__).resolve().parents[3]  # the directory that holds `trapo/`


class _StartFailed(Exception):
    """A supervisor exited or hung while importing Math-Verify."""


class GraderStartError(RuntimeError):
    """No supervisor has ever started: two tries in a row failed, as a broken installation does. One line."""


class _Unavailable(Exception):
    """No supervisor could be (re)started for now: this request's items are FAILED."""


def supervisor_env(base) -> dict[str, str]:
    """The environment of a supervisor started from a process in `base`."""
    # A fixed hash seed: Math-Verify's verdict on degenerate answers (`0` vs `4 0/0`) follows set and dict
    # order, which would otherwise change from run to run. Executors fork from the supervisor: same seed.
    # (sympy's own random order is reset before each item: `executor._run_item`.)
    env = {**base, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    # The supervisor imports this package: the directory that holds `trapo/` goes first on its path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_PARENT), env.get("PYTHONPATH", "")) if p)
    return env


def start_supervisor(num_workers: int, max_workers: int, spec: str) -> subprocess.Popen:
    """The supervisor process of one verifier, as a `subprocess.Popen` (what `MathVerifier` uses of it: `pid`,
    `stdin`, `stdout`, `poll()`, `kill()`, `wait()`). The one place a supervisor is started: the test suite
    replaces it to fork supervisors from a warm parent."""
    return subprocess.Popen(
        [sys.executable, "-m", "trapo.engine.grading.supervisor", str(num_workers), str(max_workers), spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=supervisor_env(os.environ),
        # Its own session: a Ctrl-C at the terminal reaches the trainer, which finishes its step
        # (grading included) before it stops; the supervisor ends when the trainer closes its stdin.
        start_new_session=True,
    )


class _SupervisorProcess:
    """The supervisor process, as the parent sees it."""

    def __init__(self, num_workers: int, max_workers: int, spec: str = "math"):
        self.proc = start_supervisor(num_workers, max_workers, spec)
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
    seconds the supervisor may take to import Math-Verify. A first supervisor
    that fails to start twice in a row raises GraderStartError (a broken
    installation); no answer content ever raises. spec: `reward.verifier`; other than `math`, the task
    verifier it names runs in the executors instead of Math-Verify
    (`verifiers`), and `extract_many` reads answers with it.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout: float = 5.0,
        startup_timeout: float = 120.0,
        max_workers: int = 8,
        spec: str = "math",
    ):
        if num_workers < 1:
            raise ValueError(f"MathVerifier: num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.max_workers = max(num_workers, max_workers)
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.spec = spec
        self.name = "Math-Verify" if spec == "math" else f"reward.verifier {spec}"
        self.errors = 0  # task verifier calls that raised, since creation
        self.timeouts = 0  # comparisons (and answers parsed) that ran out of time, since creation
        self.failed = 0  # items left undecided because grading processes died, since creation
        self._started_once = False  # a supervisor came up once: later start-up failures are deaths, not bad installs
        self._slow_answers: dict[str, float] = {}  # the supervisor's memory, mirrored (see the module doc)
        self._slow_pairs: dict[tuple[str, str], float] = {}
        self._supervisor: _SupervisorProcess | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def start(self) -> None:
        """Start the supervisor and its executors now (they start on first use otherwise)."""
        with self._lock:
            self._ready(None)

    def memory(self) -> dict:
        """What exhausted a timeout so far (plain values: a checkpoint holds it): {"answers": {answer:
        timeout}, "pairs": [[gold, pred, timeout]]}, oldest first."""
        pairs = [[g, p, t] for (g, p), t in self._slow_pairs.items()]
        return {"answers": dict(self._slow_answers), "pairs": pairs}

    def load_memory(self, memory: dict) -> None:
        """Continue with `memory` (from `memory()`, of a checkpoint): the next request's supervisor gets it."""
        with self._lock:
            self._slow_answers = dict(memory["answers"])
            self._slow_pairs = {(g, p): t for g, p, t in memory["pairs"]}
            sup = self._supervisor
            if sup is not None and sup.ready and not self._restore(sup):  # a running one is told now
                sup.kill()  # it died meanwhile: the next request starts one, which gets the memory
                self._supervisor = None

    def _restore(self, sup: _SupervisorProcess) -> bool:
        """Send the mirrored memory to `sup` and wait for its answer; False if it died meanwhile."""
        try:
            sup.send({"restore": {"answers": self._slow_answers, "pairs": list(self._slow_pairs.items())}})
        except OSError:
            return False
        while True:
            if not select.select([sup.fd], [], [], self.startup_timeout)[0]:
                return False
            lines = sup.read_lines()
            if lines is None:
                return False
            if b"restored" in lines:
                return True

    def _mirror(self, item: tuple[str, str | None], code: str, timeout: float) -> None:
        """What the supervisor remembered on a fresh timeout (`code` g*, p* or t*), in the same order."""
        gold, pred = item

        store, key = (
            (self._slow_answers, gold)
            if code == "g*" or pred is None
            else (self._slow_answers, pred)
            if code == "p*"
            else (self._slow_pairs, (gold, pred))
        )
        remember(store, key, timeout)

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
            self._supervisor = _SupervisorProcess(self.num_workers, self.max_workers, self.spec)
            faults.spend("grader_first_start")  # one-shot: the supervisor started next comes up
        return self._supervisor

    def _ready(self, deadline: float | None) -> _SupervisorProcess | None:
        """A ready supervisor: the running one, or a new one (given the mirrored memory); None when `deadline`
        comes first. A supervisor that fails to start (the first or a replacement) is tried again after each
        of _RESTART_WAITS, then _Unavailable; the first failing twice in a row is a broken installation
        (GraderStartError)."""
        first_failures = 0
        for wait in (0.0, *_RESTART_WAITS):
            if wait:
                if deadline is not None and time.monotonic() + wait >= deadline:
                    break
                time.sleep(wait)
            sup = self._ensure()
            fresh = not sup.ready
            try:
                if not self._wait_ready(sup, deadline):
                    return None
            except _StartFailed as err:
                if not self._started_once:
                    first_failures += 1
                    if first_failures == 2:  # a killed start is not repeated; a broken installation is
                        raise GraderStartError(f"{self.name} failed to start twice in a row: {err}") from None
                log.warning("%s: a supervisor failed to start (%s); trying again", self.name, err)
                continue
            self._started_once = True
            if fresh and (self._slow_answers or self._slow_pairs) and not self._restore(sup):
                sup.kill()
                self._supervisor = None
                continue
            return sup
        raise _Unavailable

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
                raise _StartFailed(f"{self.name} worker did not start within {self.startup_timeout:.0f} s")
            lines = sup.read_lines()
            if lines is None:
                sup.kill()
                self._supervisor = None
                raise _StartFailed(
                    f"{self.name} worker exited at start-up (is math-verify installed? can it import the verifier? "
                    f"try: {sys.executable} -m trapo.engine.grading.supervisor)"
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
    ) -> tuple[list[list[Verdict]], dict[str, complex]]:
        """Parse each answer once, ahead of the comparisons among each group's answers.

        Each group goes to one executor, where its comparisons will then find
        all its answers parsed. Per answer: READY, GOLD_TIMEOUT (parsing it
        exhausts the timeout: it is remembered, so no later comparison waits
        on it again) or CUT. The answers of all groups run side by side, so
        many slow ones cost about one timeout together.

        Also returns each parsed answer's probe value where it is a float-range number (the executors'
        numeric pre-filter): two answers whose values differ (`answers.values_differ`) are not equal, which
        the caller can settle without sending the pair.
        """
        unique: dict[str, int] = {}
        for g, answers in enumerate(groups):
            for a in answers:
                unique.setdefault(a, g)
        payloads: list[str | None] = [None] * len(unique)
        items = [(a, None) for a in unique]
        codes = dict(zip(unique, self._request(items, list(unique.values()), timeout, deadline, payloads)))
        ready = (Verdict.EQUAL, Verdict.NOT_EQUAL, Verdict.READY)  # a parse error is no timeout
        verdicts = [[Verdict.READY if codes[a] in ready else codes[a] for a in answers] for answers in groups]
        values = {a: decode_value(v) for a, v in zip(unique, payloads) if v}
        return verdicts, values

    def extract_many(
        self, texts: Sequence[str], timeout: float | None = None, deadline: float | None = None
    ) -> tuple[list[Verdict], list[str | None]]:
        """A task verifier's extraction of each response, in the executors: (verdicts, payloads), a payload
        (`verifiers.decode`) where the verdict is EXTRACTED, else None (it raised, timed out, was cut or
        failed). Each distinct text is extracted once."""
        if self.spec == "math":
            raise ValueError("extract_many: Math-Verify's answers are extracted in the trainer (extract_answer)")
        unique = list(dict.fromkeys(texts))
        payloads: list[str | None] = [None] * len(unique)
        from trapo.algorithm.rewards.verifiers import EXTRACT_MARK

        items = [(EXTRACT_MARK + t, None) for t in unique]
        verdicts = self._request(items, list(range(len(unique))), timeout, deadline, payloads)
        table = {t: (v, p) for t, v, p in zip(unique, verdicts, payloads)}
        return [table[t][0] for t in texts], [table[t][1] for t in texts]

    def _request(
        self, items: list, units: list[int], timeout: float | None, deadline: float | None, payloads=None
    ) -> list[Verdict]:
        """Verdicts of `items`; a task verifier's extraction code (x + payload) fills `payloads`[i]."""
        timeout = self.timeout if timeout is None else timeout
        if deadline is not None and time.monotonic() >= deadline:
            return [Verdict.CUT] * len(items)
        codes: list[str | None] = [None] * len(items)
        with self._lock:
            for _ in range(2):  # a supervisor that dies mid-request: once more on a fresh one
                todo = [i for i, c in enumerate(codes) if c is None]
                try:
                    sup = self._ready(deadline)
                except _Unavailable:
                    break
                if sup is None:  # still importing Math-Verify when the budget ran out
                    codes = [c or Verdict.CUT.value for c in codes]
                    break
                sup.send(
                    {
                        "items": [items[i] for i in todo],
                        "units": [units[i] for i in todo],
                        "timeout": timeout,
                        "deadline": deadline,
                    }
                )
                for i, code in zip(todo, self._collect(sup, len(todo), timeout)):
                    if code is not None and code.endswith("*"):
                        self._mirror(items[i], code, timeout)
                    codes[i] = code and code.rstrip("*")
                    if code is not None and code[:1] in ("x", "r"):  # an extraction, or a parsed answer's value
                        if payloads is not None:
                            payloads[i] = code[1:]
                        codes[i] = code[0]
                if all(c is not None for c in codes):
                    break
            verdicts = [Verdict(c or Verdict.FAILED.value) for c in codes]  # None: no supervisor answered it
            failed = sum(v is Verdict.FAILED for v in verdicts)
            errors = [item for item, v in zip(items, verdicts) if v is Verdict.ERROR]
            slow = [item for item, v in zip(items, verdicts) if v.timed_out]
            self.timeouts += len(slow)
            self.failed += failed
            self.errors += len(errors)
        if failed:
            log.warning(
                "%s: %d item(s) undecided: grading processes died on them and were replaced; scored as "
                "not equal (counted in grading_failed)",
                self.name,
                failed,
            )
        if errors:
            log.warning(
                "%s: %d call(s) raised; scored as wrong (counted in grading_failed; first: %s)",
                self.name,
                len(errors),
                _first(errors[0]),
            )
        if slow:
            log.warning(
                "%s: %d item(s) exceeded %.1f s; scored as not equal (first: %s)",
                self.name,
                len(slow),
                timeout,
                _first(slow[0]),
            )
        return verdicts

    def _collect(self, sup: _SupervisorProcess, n: int, timeout: float) -> list[str | None]:
        """The supervisor's answers; one that dies or falls silent is killed, and what it left is None."""
        codes: list[str | None] = [None] * n
        left, last = n, time.monotonic()
        while left:
            wait = last + timeout + _STALL_S - time.monotonic()
            lines = sup.read_lines() if wait > 0 and select.select([sup.fd], [], [], wait)[0] else None
            if lines is None:
                log.warning("Math-Verify supervisor died or stalled with %d item(s) unanswered; replacing it", left)
                sup.kill()
                self._supervisor = None
                return codes
            for line in lines:
                index, code = line.split()
                codes[int(index)] = code.decode()
                left -= 1
            last = time.monotonic()
        return codes


def _first(item: tuple[str, str | None]) -> str:
    gold, pred = item
    return f"parsing {gold!r:.60}" if pred is None else f"gold {gold!r:.60}, pred {pred!r:.60}"


def merged(memories: list[dict]) -> dict:
    """Several verifiers' `memory()` as one (a checkpoint saved on more ranks than resume it): every answer
    and pair any of them remembered, at the longest timeout it exhausted."""
    answers: dict[str, float] = {}
    pairs: dict[tuple[str, str], float] = {}
    for memory in memories:
        for answer, timeout in memory["answers"].items():
            answers[answer] = max(timeout, answers.get(answer, 0.0))
        for gold, pred, timeout in memory["pairs"]:
            pairs[(gold, pred)] = max(timeout, pairs.get((gold, pred), 0.0))
    return {"answers": answers, "pairs": [[g, p, t] for (g, p), t in pairs.items()]}


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier, for callers without a config: min(2, CPUs) workers."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier(num_workers=min(2, os.cpu_count() or 1))
        return _default
