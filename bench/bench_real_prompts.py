"""Which prompt SmolLM2-135M-Instruct can learn the word problems from: its pass rates under each prompt tried.

    python bench/bench_real_prompts.py [--model models/SmolLM2-135M-Instruct] [--questions 8] [--out FILE]

The same questions (`--questions` per cell of 1 and 2 steps, tiny and small numbers, from
trapo/commands/word_problems.py), 8 samples each at the rollout temperature of configs/real_smollm2.yaml, at most
48 tokens, through vLLM, graded by Math-Verify as the trainer grades them. Per prompt: the mean pass rate per
cell, the share of questions whose 8 samples are all wrong (no learning signal), the boxed and truncated shares,
and the prompt's length in tokens (every trained sequence carries it through the update). `make real-figures`
writes what it prints into docs/real-model.md.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trapo import runtime  # noqa: E402

runtime.configure()  # before torch and vLLM are imported

from trapo.commands import word_problems as wp  # noqa: E402

SYSTEM = wp.PROMPT[0]
TWO_STEP_EXAMPLE = wp.PROMPT[1:3]  # Mia's shells: a box start and a gift, one line per step
INLINE = [
    {"role": "user", "content": wp.PROMPT[1]["content"]},
    {"role": "assistant", "content": "3 * 6 = 18. 18 - 5 = 13. The answer is \\boxed{13}."},
]
QUESTION = [{"role": "user", "content": "{question}"}]
# name -> (messages, what it is)
PROMPTS = {
    "none": (QUESTION, "the question alone (the chat template's default system turn)"),
    "inline": ([SYSTEM, *INLINE, *QUESTION], "the system turn and one worked example written in a sentence"),
    "one_example": ([SYSTEM, *TWO_STEP_EXAMPLE, *QUESTION], "the system turn and one worked example, a line a step"),
    "shipped": (wp.PROMPT, "word_problems.PROMPT: the system turn and two worked examples, a line a step"),
}
CELLS = [(1, "tiny"), (1, "small"), (2, "tiny"), (2, "small")]
N, MAX_TOKENS = 8, 48


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--questions", type=int, default=8, help="questions per cell")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--out", help="also write the printed lines into this file")
    args = p.parse_args()
    import yaml
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from trapo.training.evaluation import grade_responses

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        kv_cache_memory_bytes=512 * 2**20,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
    )
    questions = [(cell, q) for cell in CELLS for q in wp.problems(101, args.questions, *cell)]
    config = yaml.safe_load(open(os.path.join(runtime.ROOT, "configs", "real_smollm2.yaml")))
    lines = [
        f"prompts for {os.path.basename(args.model)}: {args.questions} questions per cell, {N} samples at "
        f"temperature {args.temperature:g} (configs/real_smollm2.yaml: {config['rollout']['temperature']}), "
        f"<= {MAX_TOKENS} tokens, vLLM, Math-Verify",
        f"{'prompt':<12} {'tokens':>6}  "
        + "  ".join(f"{s}-step {r:<5}" for s, r in CELLS)
        + "  all-wrong  boxed  truncated",
    ]
    for name, (messages, _) in PROMPTS.items():
        texts = [
            tokenizer.apply_chat_template(
                [{**m, "content": m["content"].replace("{question}", q.question)} for m in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            for _, q in questions
        ]
        started = time.perf_counter()
        outs = llm.generate(
            texts, SamplingParams(n=N, temperature=args.temperature, max_tokens=MAX_TOKENS, seed=0), use_tqdm=False
        )
        seconds = time.perf_counter() - started
        per_cell: dict = {cell: [] for cell in CELLS}
        zero = boxed = cut = 0
        for (cell, q), out in zip(questions, outs):
            grades = grade_responses([o.text for o in out.outputs], str(q.answer))
            right = sum(g["correct"] for g in grades)
            per_cell[cell].append(right / N)
            zero += right == 0
            boxed += sum("\\boxed{" in o.text for o in out.outputs)
            cut += sum(o.finish_reason == "length" for o in out.outputs)
        total = len(questions) * N
        length = len(tokenizer(texts[0])["input_ids"]) - len(tokenizer(questions[0][1].question)["input_ids"])
        cells = "  ".join(f"{sum(v) / len(v):>12.3f}" for v in per_cell.values())
        lines.append(
            f"{name:<12} {length:>6}  {cells}  {zero / len(questions):>9.2f}  {boxed / total:>5.2f}  "
            f"{cut / total:>9.2f}   ({seconds:.0f} s)"
        )
    lines += [f"  {name}: {what}" for name, (_, what) in PROMPTS.items()]
    print("\n".join(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
