"""Preemption-safe stop: SIGTERM or SIGINT finishes the current step, saves, exits with EXIT_CODE.

Clusters preempt jobs with SIGTERM. The first signal only sets a flag; the
trainer checks it after each step, agreed over all ranks (so every rank stops
after the same step), saves a checkpoint and raises `Preempted`. A second
signal (more than a few seconds later) stops at once, the way the signal
would have without us.
"""

from __future__ import annotations

import os
import signal
import time

from trapo import console
from trapo.engine.policy import TrainingError


class Preempted(TrainingError):
    """The run stopped on a signal after saving a checkpoint; `resume_from: latest` continues it."""

    EXIT_CODE = 75  # EX_TEMPFAIL: try again later (a scheduler can requeue on it)


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    # A second signal this soon after the first is the same request delivered twice, not a user
    # insisting: a Ctrl-C reaches every process of the group, and the deepspeed launcher then
    # forwards a SIGTERM of its own to each rank.
    DUPLICATE_WITHIN_S = 5.0

    def __init__(self):
        self.received: str | None = None  # the first signal's name
        self._first_at = 0.0
        self._previous = {}

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if time.monotonic() - self._first_at < self.DUPLICATE_WITHIN_S:
                return
            signal.signal(signum, signal.SIG_DFL)  # a second request: default behaviour, now
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum).name
        self._first_at = time.monotonic()
        console.say(f"{self.received}: finishing this step, then saving a checkpoint (send it again to stop now)")
