"""Step-time breakdown of the toy run, and the weight push's share of it.

Runs the real trainer (DeepSpeed ZeRO-3 + vLLM + Math-Verify, one process) for
a few steps on the toy task and prints each phase's median time per step, the
weight push (gather + reload) as a fraction of the step (target <= 5%), and
its seconds per GB of weights pushed, for projecting to a large model.
"""

import atexit
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trapo import runtime  # noqa: E402

runtime.configure()  # before torch and vLLM are imported

from trapo.commands import toy  # noqa: E402
from trapo.config import load_config  # noqa: E402
from trapo.training.trainer import Trainer  # noqa: E402

STEPS = 12


def main() -> None:
    out = tempfile.mkdtemp(prefix="bench-step-")
    atexit.register(shutil.rmtree, out, True)  # the run's checkpoints and logs are scratch
    cfg = load_config(os.path.join(ROOT, "configs", "toy.yaml"), [f"output_dir={out}", "data.test_files=[]"])
    toy.prepare(cfg)
    t = Trainer(cfg)
    logs = [t.train_step() for _ in range(STEPS)]
    t.close()
    logs = logs[2:]  # first steps include one-time warm-up
    phases = ["rollout", "grading", "update", "weight_push", "step"]
    med = {p: statistics.median(v["timing"].get(p, 0.0) for v in logs) for p in phases}
    shape = f"{cfg.train.rollout_batch_size} questions x {cfg.rollout.n} rollouts"
    print(f"toy step breakdown, median over {len(logs)} steps ({shape}):")
    for p in phases:
        print(f"  {p:12s} {med[p] * 1000:8.1f} ms  {med[p] / med['step']:6.1%}")
    gb = statistics.median(v["pushed_gb"] for v in logs)
    frac = med["weight_push"] / med["step"]
    print(
        f"weight push: {frac:.1%} of step time (target <= 5%: {'met' if frac <= 0.05 else 'MISSED'}), "
        f"{gb * 1024:.2f} MB per push, {med['weight_push'] / gb:.2f} s/GB"
    )
    print(f"rollout throughput: {statistics.median(v['tokens_per_s'] for v in logs):.0f} response tokens/s")


if __name__ == "__main__":
    main()
