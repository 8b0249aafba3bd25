"""Rollout throughput: our engine wrapper vs calling vllm.LLM.generate directly.

Same engine, model (the toy), prompts, sampling settings and seeds; the two are
timed alternately over several rounds and the medians compared.
Target: wrapper throughput >= 95% of raw vLLM.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trapo import runtime  # noqa: E402

runtime.configure()  # before torch and vLLM are imported

from trapo.commands.toy import build_assets  # noqa: E402
from trapo.config import ToyConfig  # noqa: E402
from trapo.data import load_questions, tokenize_prompts  # noqa: E402
from trapo.engine.rollout import RolloutEngine  # noqa: E402

ROUNDS, N, MAX_TOKENS = 7, 8, 12


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    root = build_assets(ToyConfig(dir="outputs/toy-assets", sft_steps=600))
    tok = AutoTokenizer.from_pretrained(root / "model")
    prompts = tokenize_prompts(load_questions([str(root / "train.jsonl")]), "plain", tok, 16)[:128]
    seeds = list(range(len(prompts)))
    engine = RolloutEngine(str(root / "model"), dtype="float32", max_model_len=32, seed=0)

    def ours() -> int:
        out = engine.generate(prompts, n=N, temperature=1.0, max_tokens=MAX_TOKENS, seeds=seeds)
        return sum(len(r.token_ids) for g in out for r in g)

    def raw() -> int:
        params = [SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=s) for s in seeds]
        out = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in out for c in o.outputs)

    ours(), raw()  # warm-up
    t_ours, t_raw = [], []
    for _ in range(ROUNDS):
        for fn, times in ((raw, t_raw), (ours, t_ours)):
            start = time.perf_counter()
            tokens = fn()
            times.append(tokens / (time.perf_counter() - start))
    ratio = statistics.median(t_ours) / statistics.median(t_raw)
    print(f"rollout: {len(prompts)} prompts x n={N}, {MAX_TOKENS} new tokens max, {ROUNDS} rounds")
    print(f"  raw vllm.LLM.generate : {statistics.median(t_raw):8.0f} tokens/s (median)")
    print(f"  trapo RolloutEngine   : {statistics.median(t_ours):8.0f} tokens/s (median)")
    print(f"  ratio ours/raw        : {ratio:.3f}  (target >= 0.95: {'met' if ratio >= 0.95 else 'MISSED'})")


if __name__ == "__main__":
    main()
