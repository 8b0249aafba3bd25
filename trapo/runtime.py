"""Process environment for the training stack, decided in one place.

Some settings must be in the environment before torch or vLLM is imported, and
some are right only on CPU:
    VLLM_ENABLE_V1_MULTIPROCESSING=0  every device: the colocated engine runs in the
                                      trainer's process (the weight push hands tensors
                                      over by reference; external_launcher needs it)
    VLLM_LOGGING_LEVEL=WARNING        every device: per-request INFO lines bury the console
    TORCHDYNAMO_DISABLE=1             CPU only: on GPU it would turn vLLM's compiled
                                      model and CUDA graphs off
    OMP_NUM_THREADS=1                 CPU only: unbounded OpenMP makes step times swing
                                      widely on small machines (docs/upstream-notes.md)
A value already in the environment always wins. Entry points call `configure()`
first thing; code that starts a Python subprocess passes `subprocess_env()`.
"""

from __future__ import annotations

import glob
import os
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALWAYS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
CPU_ONLY = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def has_gpu() -> bool:
    """An NVIDIA device node is present (checked without importing torch, so it can run first).

    TRAPO_DEVICE=cpu|cuda overrides the probe.
    """
    forced = os.environ.get("TRAPO_DEVICE")
    if forced:
        return forced == "cuda"
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def settings(gpu: bool | None = None) -> dict[str, str]:
    """The variables this device needs (not yet merged with the environment)."""
    gpu = has_gpu() if gpu is None else gpu
    return dict(ALWAYS) if gpu else {**ALWAYS, **CPU_ONLY}


NOTICES: list[str] = []  # what `configure` changed against the user's environment, said at start-up


def configure(gpu: bool | None = None) -> None:
    """Set the device's variables in this process, keeping any the user set (but one, below). Call
    before importing torch."""
    gpu = has_gpu() if gpu is None else gpu
    # A TORCHDYNAMO_DISABLE inherited from a shell that ran CPU work would turn vLLM's compiled
    # model and CUDA graphs off on GPU, silently and slowly.
    if gpu and os.environ.pop("TORCHDYNAMO_DISABLE", None) is not None:
        NOTICES.append(
            "TORCHDYNAMO_DISABLE was set in the environment: unset on GPU, where it turns off "
            "vLLM's compiled model and CUDA graphs"
        )
    for key, value in settings(gpu).items():
        os.environ.setdefault(key, value)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a Python child process running project code: ours, `extra`, the repo importable."""
    env = {**settings(), **os.environ, **extra}
    # the repo first, once: a child's own children get the same PYTHONPATH, not one more copy at each level
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])
    return env


def dtype_name(name: str) -> str:
    """A config's `dtype` resolved: "auto" is bfloat16 on GPU and float32 on CPU; others pass through."""
    import torch

    if name == "auto":
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return name


def torch_dtype(name: str):
    """The torch dtype of a config's `dtype` (see `dtype_name`)."""
    import torch

    return getattr(torch, dtype_name(name))


@contextmanager
def intra_op_threads(n: int | None):
    """torch's intra-op CPU threads set to `n` for the block, then restored (None: left as they are). Through
    torch._C: vLLM's CPU worker replaces torch.set_num_threads with a no-op in the process that runs it."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
