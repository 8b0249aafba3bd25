"""Rollout throughput of our two backends, each against the plain call it wraps, on the toy model.

    python bench/bench_rollout.py                 # vLLM: our VllmEngine vs vllm.LLM.generate (target >= 0.95)
    python bench/bench_rollout.py --backend hf    # hf: our HfEngine vs transformers' model.generate (>= 0.95),
                                                  # and, with vLLM installed, against our vLLM backend

Same model (the toy), prompts (128 questions), n = 8 samples each, 12 new tokens at most, temperature 1;
the paths are timed alternately over several rounds and their best rounds compared. The vLLM run also prints
what vLLM's own detokenizer costs (detokenize=True, the default) against our detokenize=False and one
batch_decode per call.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trapo import runtime  # noqa: E402

runtime.configure()  # before torch and vLLM are imported

from trapo.commands.toy import build_assets  # noqa: E402
from trapo.config import BACKENDS, ToyConfig  # noqa: E402
from trapo.data import load_questions, stop_token_ids, tokenize_prompts  # noqa: E402

ROUNDS, N, MAX_TOKENS = 15, 8, 12


def timed(paths: dict, rounds: int = ROUNDS) -> dict[str, float]:
    """Best tokens/s of each path (a function returning its token count) over `rounds` rounds after a warm-up,
    the paths alternating, in reverse order every other round. The best round, not the median: on a shared
    2-core machine other work only ever slows a round down, and medians moved by 15% between runs."""
    for fn in paths.values():
        fn()
    speeds: dict[str, list[float]] = {name: [] for name in paths}
    for k in range(rounds):
        for name, fn in list(paths.items())[:: 1 if k % 2 == 0 else -1]:
            start = time.perf_counter()
            tokens = fn()
            speeds[name].append(tokens / (time.perf_counter() - start))
    return {name: max(v) for name, v in speeds.items()}


def report(title: str, speeds: dict[str, float], ours: str, reference: str, target: float | None) -> None:
    print(title)
    for name, tps in speeds.items():
        print(f"  {name:<34}: {tps:8.0f} tokens/s (best round)")
    ratio = speeds[ours] / speeds[reference]
    verdict = f"  (target >= {target}: {'met' if ratio >= target else 'MISSED'})" if target else ""
    print(f"  ratio {ours} / {reference}: {ratio:.3f}{verdict}")


def vllm_paths(model_dir, tokenizer, prompts, seeds) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trapo.engine.vllm_rollout import VllmEngine

    engine = VllmEngine(str(model_dir), tokenizer=tokenizer, dtype="float32", max_model_len=32, seed=0)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def ours() -> int:
        out = engine.generate(prompts, n=N, temperature=1.0, max_tokens=MAX_TOKENS, seeds=seeds)
        return sum(len(r.token_ids) for g in out for r in g)

    def raw(detokenize: bool):
        def call() -> int:
            params = [
                SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=s, detokenize=detokenize)
                for s in seeds
            ]
            out = engine.llm.generate(requests, params, use_tqdm=False)
            return sum(len(c.token_ids) for o in out for c in o.outputs)

        return call

    return {"trapo VllmEngine": ours, "raw vllm.LLM.generate": raw(True)}


def detokenizer_cost(model_dir, tokenizer, prompts) -> float:
    """The share of a 256-token generate that vLLM's incremental detokenizer takes: detokenize=True against
    detokenize=False plus one batch_decode of every response (what VllmEngine does), EOS ignored so every
    response is 256 tokens long."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trapo.engine.rollout import decode_responses

    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=512,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=2**30,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
    )
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts[:32]]

    def call(detokenize: bool):
        def run() -> int:
            params = SamplingParams(n=4, temperature=1.0, max_tokens=256, ignore_eos=True, detokenize=detokenize)
            out = llm.generate(requests, params, use_tqdm=False)
            responses = [list(c.token_ids) for o in out for c in o.outputs]
            if not detokenize:
                decode_responses(tokenizer, responses, [])
            return sum(map(len, responses))

        return run

    speeds = timed({"detokenize=True": call(True), "detokenize=False + batch_decode": call(False)}, rounds=5)
    return 1 - speeds["detokenize=True"] / speeds["detokenize=False + batch_decode"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=[b for b in BACKENDS if b != "auto"], default="vllm")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trapo.engine.rollout import installed

    root = build_assets(ToyConfig(dir="outputs/toy-assets", sft_steps=600))
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    prompts = tokenize_prompts(load_questions([str(root / "train.jsonl")]), "plain", tokenizer, 16)[:128]
    seeds = list(range(len(prompts)))
    setup = f"{len(prompts)} prompts x n={N}, {MAX_TOKENS} new tokens max, {ROUNDS} rounds, toy model, CPU fp32"
    if args.backend == "vllm":
        speeds = timed(vllm_paths(root / "model", tokenizer, prompts, seeds))
        report(f"rollout, vLLM backend: {setup}", speeds, "trapo VllmEngine", "raw vllm.LLM.generate", 0.95)
        cost = detokenizer_cost(root / "model", tokenizer, prompts)
        print(f"  vLLM's detokenizer: {cost:.1%} of a 32 x 4 x 256-token generate (we decode once per call instead)")
        return

    from trapo.engine.hf_rollout import HfEngine

    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    engine = HfEngine(model, tokenizer, stop_token_ids=stops, max_batch=len(prompts) * N)
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def ours() -> int:
        out = engine.generate(prompts, n=N, temperature=1.0, max_tokens=MAX_TOKENS, seeds=seeds)
        return sum(len(r.token_ids) for g in out for r in g)

    def plain() -> int:  # one left-padded batch, as ours runs it; tokens up to and including the stop
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                num_return_sequences=N,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )[:, width:]
        stopped = torch.isin(out, torch.tensor(stops))
        ends = torch.where(stopped.any(1), stopped.int().argmax(1) + 1, torch.full((len(out),), out.shape[1]))
        return int(ends.sum())

    # The two hf paths first: a vLLM engine built in this process binds the CPU threads for good.
    speeds = timed({"trapo HfEngine": ours, "transformers model.generate": plain})
    report(f"rollout, hf backend: {setup}", speeds, "trapo HfEngine", "transformers model.generate", 0.95)
    if installed("vllm") and not torch.cuda.is_available():
        vllm = vllm_paths(root / "model", tokenizer, prompts, seeds)["trapo VllmEngine"]
        both = timed({"trapo HfEngine": ours, "trapo VllmEngine": vllm})
        print(
            f"  then, beside our vLLM backend: hf {both['trapo HfEngine']:.0f}, vLLM {both['trapo VllmEngine']:.0f} "
            f"tokens/s; hf / vLLM {both['trapo HfEngine'] / both['trapo VllmEngine']:.3f}"
        )


if __name__ == "__main__":
    main()
