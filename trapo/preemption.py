"""Preemption-safe stop: SIGTERM or SIGINT finishes the current step, saves, exits with EXIT_CODE.

Clusters preempt jobs with SIGTERM. The first signal only sets a flag; the
trainer checks it after each step, agreed over all ranks (so every rank stops
after the same step), saves a checkpoint and raises `Preempted`. A second
signal stops at once, the way the signal would have without us.
"""

from __future__ import annotations

import os
import signal

from trapo import console
from trapo.policy import TrainingError


class Preempted(TrainingError):
    """The run stopped on a signal after saving a checkpoint; `resume_from: latest` continues it."""

    EXIT_CODE = 75  # EX_TEMPFAIL: try again later (a scheduler can requeue on it)


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None  # the first signal's name
        self._previous = {}

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second one: default behaviour, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum).name
        console.say(f"{self.received}: finishing this step, then saving a checkpoint (send it again to stop now)")
