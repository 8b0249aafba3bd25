"""Selection cost at the paper's largest scale: 45,000 unlabeled questions, 50 epochs.

Prints the time of one end-of-epoch selection (TCS to the reliable mean
trajectory + reliable_mask + database update) against the 50 ms target, and
beside it a per-question Python loop doing the same cosine, in one run.
Run: make bench (or .venv/bin/python bench/bench_selection.py).
"""

import math
import os
import time

from trapo import runtime  # noqa: E402

runtime.configure()  # bounded threads before torch is imported

import torch  # noqa: E402

from trapo.algorithm.passrate import PassRateTracker, SelectionConfig, reliable_mask  # noqa: E402

N_UNLABELED, N_LABELED, EPOCHS = 45_000, 5_000, 50
TARGET_MS = 50.0


def make_tracker(**cfg) -> PassRateTracker:
    g = torch.Generator().manual_seed(0)
    labeled = torch.zeros(N_UNLABELED + N_LABELED, dtype=torch.bool)
    labeled[:N_LABELED] = True
    tr = PassRateTracker(labeled, SelectionConfig(warmup_epochs=EPOCHS + 1, **cfg))
    # Rising pass rates with noise, clipped to [0, 1], for EPOCHS - 1 epochs.
    for t in range(EPOCHS - 1):
        tr.record(
            torch.arange(labeled.numel()), (torch.rand(labeled.numel(), generator=g) * 0.5 + t / EPOCHS).clamp(0, 1)
        )
        tr.end_epoch()
    tr.config.warmup_epochs = EPOCHS
    tr.record(torch.arange(labeled.numel()), torch.rand(labeled.numel(), generator=g))
    return tr


def time_end_epoch(tr: PassRateTracker, repeats: int = 5) -> float:
    state = tr.state_dict()
    best = math.inf
    for _ in range(repeats):
        tr.load_state_dict(state)
        start = time.perf_counter()
        report = tr.end_epoch()
        best = min(best, time.perf_counter() - start)
    assert tr.epoch == EPOCHS and report["selected"] > 0
    return best * 1e3


def python_loop_ms(tr: PassRateTracker) -> float:
    traj = tr.trajectories[~tr.labeled].tolist()
    ref = tr.mean_reference().tolist()
    start = time.perf_counter()
    ref_norm = math.sqrt(sum(v * v for v in ref))
    scores = []
    for row in traj:
        norm = math.sqrt(sum(v * v for v in row))
        scores.append(0.0 if norm == 0 else sum(a * b for a, b in zip(row, ref)) / (norm * ref_norm))
    reliable_mask(torch.tensor(scores), 0.1, 0.4)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(f"selection over {N_UNLABELED} unlabeled + {N_LABELED} labeled questions, {EPOCHS}-epoch trajectories")
    tr = make_tracker()
    ours = time_end_epoch(tr)
    loop = python_loop_ms(make_tracker())
    print(
        f"  end_epoch (paper: TCS to mean, top-p 0.1 | Gamma 0.4): {ours:7.2f} ms   target {TARGET_MS:.0f} ms   "
        f"ratio {ours / TARGET_MS:.3f} of target"
    )
    print(
        f"  per-question Python loop, same cosine:               {loop:7.2f} ms   "
        f"vectorised is {loop / ours:.0f}x faster"
    )
    for cfg in ({"reference": "mean_cosine", "standardize": True}, {"reference": "max_cosine"}):
        ms = time_end_epoch(make_tracker(**cfg), repeats=2)
        print(f"  end_epoch {cfg}: {ms:8.2f} ms")


if __name__ == "__main__":
    main()
