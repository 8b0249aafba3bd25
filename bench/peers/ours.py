"""Our side of bench/peers: the trainer on the toy job (or with --real, configs/real_smollm2.yaml's model and
labeled word problems), one process, with the backend asked for.

Run by bench/peers/run.py with the project's Python; prints one JSON line: seconds to the first step and,
per step, the rollout (generation), the step's total and so the rest (grading, the update)."""

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time

STARTED = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from trapo import runtime  # noqa: E402

runtime.configure()  # before torch and vLLM are imported

from trapo.commands import toy  # noqa: E402
from trapo.config import load_config  # noqa: E402
from trapo.training.trainer import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", help="toy.dir: the toy's asset folder (the toy job)")
    ap.add_argument("--real", action="store_true", help="the real job: configs/real_smollm2.yaml's model and data")
    ap.add_argument("--temperature", type=float, default=1.0, help="TRL's (its GRPOConfig here)")
    ap.add_argument("--backend", choices=("hf", "vllm"), required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    output_dir = tempfile.mkdtemp(prefix="bench-peers-")
    atexit.register(shutil.rmtree, output_dir, True)  # the run's checkpoints and logs are scratch
    overrides = [
        f"output_dir={output_dir}",
        *([] if args.real else [f"toy.dir={args.toy}"]),
        f"rollout.temperature={args.temperature}",
        "mode=supervised",  # labeled questions only: what TRL's GRPOTrainer trains on
        f"rollout.backend={args.backend}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.tokens}",
        f"rollout.min_tokens={args.tokens}",  # forced lengths, as TRL's min_new_tokens
        f"train.rollout_batch_size={args.questions}",
        f"train.update_batch_size={args.questions}",  # one update per step
        "loss.entropy_coef=0.0",  # TRL computes no entropy bonus
        "train.update_threads=null",  # every side on the process's one thread (OMP_NUM_THREADS=1), as TRL's
        "data.test_files=[]",
        "progress_bar=false",
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "real_smollm2.yaml" if args.real else "toy.yaml"), overrides)
    toy.prepare(cfg)
    trainer = Trainer(cfg)
    startup = time.perf_counter() - STARTED
    times = {"generate": [], "step": [], "mean_length": [], "reward": [], "skipped": []}
    for _ in range(args.steps):
        log = trainer.train_step()
        times["generate"].append(log["timing"]["rollout"])
        times["step"].append(log["timing"]["step"])
        times["mean_length"].append(log["response_tokens"] / (args.questions * args.n))
        times["reward"].append(log["reward_labeled"])
        times["skipped"].append(log["skipped"])  # no update: no signal in the batch
    trainer.close()
    print(json.dumps({"side": f"ours-{args.backend}", "startup": startup, **times}), flush=True)


if __name__ == "__main__":
    main()
