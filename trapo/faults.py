"""Fault injection, in one place: production code asks `hit(name)` and this module alone reads the switch.

The switch is the environment variable TRAPO_FAULT=<name>, so child processes (the trainer a test launches,
the grader's forked executors) inherit it; unset, every hook is a no-op. Tests switch a fault on with
`env(name)` for a child process, or `monkeypatch.setenv(VARIABLE, name)` in-process. The faults:

    push_noise    every weight pushed into the vLLM engine gets Gaussian noise of 8x its own spread: the
                  engine samples garbage, as after a corrupted sync (rollout.health trips; docs/reliability.md)
    grader_crash  a Math-Verify executor given the gold GRADER_CRASH_GOLD kills itself, every time, as the
                  out-of-memory killer would, so the grader's recovery path runs deterministically
    grader_first_start
                  the first Math-Verify supervisor kills itself during its start-up, as the out-of-memory
                  killer would; one-shot: the process that started it switches the fault off (`spend`), so the
                  retry starts
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from typing import NoReturn

VARIABLE = "TRAPO_FAULT"
FAULTS = ("push_noise", "grader_crash", "grader_first_start")
GRADER_CRASH_GOLD = "trapo-fault-grader-crash"


def hit(name: str) -> bool:
    """Whether fault `name` is switched on in this process."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; one of {', '.join(FAULTS)}")
    return os.environ.get(VARIABLE) == name


def env(name: str) -> dict[str, str]:
    """The environment entry that switches fault `name` on in a child process."""
    hit(name)  # an unknown name fails here, not silently in the child
    return {VARIABLE: name}


def spend(name: str) -> None:
    """Switch the one-shot fault `name` off in this process and the children it starts from now on."""
    if hit(name):
        del os.environ[VARIABLE]


def noisy(named_tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """push_noise's effect: each floating-point tensor (of more than one element) plus noise of 8x its spread,
    drawn from one generator seeded 0 so a run with the fault repeats itself."""
    import torch

    generator = torch.Generator().manual_seed(0)
    for name, tensor in named_tensors:
        if tensor.is_floating_point() and tensor.numel() > 1:
            spread = torch.randn(tensor.shape, generator=generator).to(tensor.device, tensor.dtype)
            tensor = tensor + spread * (8 * tensor.float().std()).to(tensor.dtype)
        yield name, tensor


def crash() -> NoReturn:
    """grader_crash's and grader_first_start's effect: this process dies at once, as the out-of-memory killer's
    SIGKILL ends it."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL cannot be caught
