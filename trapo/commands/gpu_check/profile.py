"""Where a phase's time goes: a torch-profiler summary of one stretch of work (`make gpu-bench`).

    with profiled("update", into, device):   # the block runs under torch.profiler
        ...
    into["update"]                            # its summary (`summarize`)

The summary names the kernels that took the most device time (on CPU, the operators that took the most CPU
time: there they are the kernels) and the share of the stretch's wall time that no kernel covered: launch
overhead, Python, host-device waits. A decode step that is launch-bound shows a large share outside kernels;
an update near the hardware, a small one.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

TOP = 10  # kernels named in a summary


def summarize(events, wall_s: float, device: str, top: int = TOP) -> dict:
    """The summary of a profile's averaged events (`prof.key_averages()`: each has `key`, `count` and
    `self_device_time_total` / `self_cpu_time_total` in microseconds) over a stretch of `wall_s` seconds.

    device "cuda": kernels are the events with self device time; "cpu": the operators with self CPU time
    (names starting "aten::"). Returns {"wall_s", "kernel_s", "outside_share" (1 - kernel time / wall time,
    within [0, 1]), "top": [{"name", "s", "share" (of kernel time), "calls"}, ...] longest first}.
    """
    if device == "cuda":
        kernels = [(e.key, e.self_device_time_total, e.count) for e in events if e.self_device_time_total > 0]
    else:
        kernels = [(e.key, e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::")]
        kernels = [k for k in kernels if k[1] > 0]
    kernels.sort(key=lambda k: -k[1])
    total_us = sum(us for _, us, _ in kernels)
    kernel_s = total_us / 1e6
    outside = min(1.0, max(0.0, 1.0 - kernel_s / wall_s)) if wall_s > 0 else 0.0
    rows = [
        {"name": name, "s": round(us / 1e6, 6), "share": round(us / total_us, 4), "calls": calls}
        for name, us, calls in kernels[:top]
    ]
    return {"wall_s": round(wall_s, 4), "kernel_s": round(kernel_s, 4), "outside_share": round(outside, 4), "top": rows}


@contextmanager
def profiled(name: str, into: dict, device: str):
    """Run the block under torch.profiler (CPU activity, and CUDA's on a GPU) and put its `summarize`d profile
    into `into[name]`. The device is synchronized at both ends, so the wall time covers the kernels launched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with profile(activities=activities) as prof:
        sync()
        started = time.perf_counter()
        yield
        sync()
        wall = time.perf_counter() - started
    into[name] = summarize(prof.key_averages(), wall, device)


def lines(summary: dict, title: str, top: int = 5) -> list[str]:
    """A summary as report lines: its wall time, the share outside kernels, the longest kernels."""
    head = (
        f"{title}: {summary['wall_s']:.3f} s, kernels {summary['kernel_s']:.3f} s, "
        f"outside kernels {summary['outside_share']:.0%}"
    )
    return [head] + [f"  {r['share']:6.1%}  {r['calls']:7d} x  {r['name'][:90]}" for r in summary["top"][:top]]
