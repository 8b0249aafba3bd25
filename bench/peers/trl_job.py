"""TRL's side of bench/peers: GRPOTrainer (TRL 1.16, transformers generation) on the toy job, one process.

Run by bench/peers/run.py with .venv-peers' Python; prints one JSON line: seconds to the first step and,
per step, the time TRL spent generating, the step's total and so the rest (scoring, the update)."""

import argparse
import json
import os
import sys
import time

STARTED = time.perf_counter()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from math_verify import parse, verify  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", required=True, help="the toy's asset folder (model/, train.jsonl)")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(os.path.join(args.toy, "train.jsonl"))]
    rows = [{"prompt": r["question"], "answer": r["answer"]} for r in rows if r["labeled"]]  # as mode=supervised
    model_dir = os.path.join(args.toy, "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def correct(completions, answer, **_):  # the same check as ours: Math-Verify against the answer
        return [float(verify(parse(a), parse(c))) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.questions * args.n,  # one update per step over every completion
        num_generations=args.n,
        steps_per_generation=1,
        max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},  # forced lengths, as rollout.min_tokens on ours
        temperature=1.0,
        top_p=1.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        beta=0.0,
        learning_rate=2e-4,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    times = {"generate": [], "step": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.began = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"].append(time.perf_counter() - self.began)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    generate = trainer._generate_single_turn

    def timed(*a, **k):
        began = time.perf_counter()
        out = generate(*a, **k)
        times["generate"].append(time.perf_counter() - began)
        return out

    trainer._generate_single_turn = timed
    first = {}

    class First(TrainerCallback):
        def on_step_begin(self, *a, **k):
            first.setdefault("startup", time.perf_counter() - STARTED)

    trainer.add_callback(First())
    trainer.train()
    logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lengths, rewards = [h["completions/mean_length"] for h in logged], [h["reward"] for h in logged]
    print(json.dumps({"side": "trl", "startup": first["startup"], **times, "mean_length": lengths, "reward": rewards}))


if __name__ == "__main__":
    sys.exit(main())
