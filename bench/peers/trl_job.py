"""TRL's side of bench/peers and of `make gpu-bench`'s trl_step: GRPOTrainer (TRL 1.16, transformers generation)
on one job, one process.

    trl_job.py --toy DIR --tokens N --steps S --out DIR                     # bench/peers: the toy, fp32 on CPU
    trl_job.py --model DIR --train FILE --all-rows --bf16 --micro-batch 32 ...   # gpu-bench: the 1.5B shape

Each step generates every question's answers in one generation batch (steps_per_generation = the gradient
accumulation steps) and makes one optimizer step over them, in micro-batches of `--micro-batch` rows, so no
old log-probabilities are computed (TRL's own rule when generation and update are aligned). Prints one JSON
line: seconds to the first step and, per step, the time TRL spent generating, generating and scoring (rewards,
decoding), the step's total and so the update (the step after generation and scoring: the loss's forward,
backward and the optimizer step), the mean answer length and reward, and on a GPU the step's peak memory.
"""

import argparse
import json
import os
import sys
import time

STARTED = time.perf_counter()

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from math_verify import parse, verify  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", help="the toy's asset folder (model/, train.jsonl)")
    ap.add_argument("--model", help="a model folder with its tokenizer (default: the toy's model/)")
    ap.add_argument("--train", help="a training file of question/answer rows (default: the toy's train.jsonl)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--all-rows", action="store_true", help="every row, labeled or not (default: labeled only)")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, help="rows per forward and backward (default: all in one)")
    ap.add_argument("--bf16", action="store_true", help="the model in bf16, trained in bf16 (a GPU run)")
    # TRL's GRPOConfig defaults to checkpointing, which bench/peers has always run with
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not args.toy and not (args.model and args.train):
        ap.error("give --toy, or --model and --train")
    rows = args.questions * args.n
    if args.micro_batch and rows % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} does not divide the step's {rows} answers")
    return args


def main(argv=None) -> None:
    args = arguments(argv)
    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    train = args.train or os.path.join(args.toy, "train.jsonl")
    rows = [json.loads(line) for line in open(train)]
    # labeled rows only as mode=supervised; --all-rows as the shape step's naive_semi, which trains them all
    # a row's "messages" (the real job: the stored chat, worked examples and all) is TRL's conversational prompt
    rows = [
        {"prompt": r.get("messages", r["question"]), "answer": r["answer"]}
        for r in rows
        if args.all_rows or r["labeled"]
    ]
    model_dir = args.model or os.path.join(args.toy, "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # bf16: the checkpoint's dtype, as TRL loads it by default (dtype="auto"): weights and AdamW states in bf16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if args.bf16 else torch.float32)

    def correct(completions, answer, **_):  # the same check as ours: Math-Verify against the answer
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
        return [float(verify(parse(a), parse(t))) for t, a in zip(texts, answer)]

    answers = args.questions * args.n
    micro = args.micro_batch or answers
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=answers // micro,  # one optimizer step per step over every completion
        steps_per_generation=answers // micro,  # every answer of the step generated at once, before the update
        num_generations=args.n,
        max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},  # forced lengths, as rollout.min_tokens on ours
        temperature=args.temperature,
        top_p=1.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        beta=0.0,
        learning_rate=2e-4,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not gpu,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        seed=0,
        disable_tqdm=True,
    )
    sync = torch.cuda.synchronize if gpu else (lambda: None)  # a phase's clock stops when its kernels are done
    times = {"generate": [], "generate_score": [], "step": [], "peak_gib": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            self.began = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            times["step"].append(time.perf_counter() - self.began)
            if gpu:
                times["peak_gib"].append(round(torch.cuda.max_memory_allocated() / 2**30, 2))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )

    def timed(name, fn):
        def run(*a, **k):
            began = time.perf_counter()
            out = fn(*a, **k)
            sync()
            times[name].append(time.perf_counter() - began)
            return out

        return run

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("generate_score", trainer._generate_and_score_completions)
    first = {}

    class First(TrainerCallback):
        def on_step_begin(self, *a, **k):
            first.setdefault("startup", time.perf_counter() - STARTED)

    trainer.add_callback(First())
    trainer.train()
    logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lengths, rewards = [h["completions/mean_length"] for h in logged], [h["reward"] for h in logged]
    update = [s - g for s, g in zip(times["step"], times["generate_score"])]
    print(
        json.dumps(
            {
                "side": "trl",
                "version": trl.__version__,
                "startup": first["startup"],
                **times,
                "update": update,
                "mean_length": lengths,
                "reward": rewards,
                "answers": answers,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
