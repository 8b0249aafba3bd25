"""Rollout tokens/s per hf decode path (`make gpu-bench`): the same rows decoded by each of
rollout.hf_decoding's paths on the trainer's own policy model, side by side in one process.

Each path decodes the round's rows (questions x answers) for `tokens` forced tokens twice: the first call
captures or compiles what the path needs (its seconds are reported as the path's start-up), the second is
timed. Its log-probs are then compared with a plain forward of the same model over prompt + response (the
stop tokens held back where they were, as the trainer's health metric does): the mean absolute difference,
which must stay within the dtype's noise for every path.
"""

from __future__ import annotations

import time

import torch

from trapo.engine.static_decoding import graph_skips

CHECKED_ROWS = 16  # rows whose log-probs are checked against a plain forward


def logprob_gap(model, prompts: list[list[int]], rollouts, held_back: list[int], forced: int) -> float:
    """Mean |rollout log-prob - plain forward's| over the rollouts' tokens (the first `forced` drawn with
    `held_back` at probability 0)."""
    gaps = []
    for prompt, rollout in zip(prompts, rollouts):
        ids = torch.tensor([prompt + rollout.token_ids], device=model.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logits[:forced, held_back] = float("-inf")
        expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        gaps.append((torch.tensor(rollout.logprobs, device=expected.device) - expected).abs())
    return float(torch.cat(gaps).mean())


def measure(engine, prompts: list[list[int]], answers: int, tokens: int, decodings: list[str]) -> dict:
    """{path: {"tokens_per_s", "first_call_s", "timed_s", "logprob_gap"} or {"error"}} for each of `decodings`,
    on `engine` (an HfEngine), whose path is restored after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    requested = engine.requested
    results = {}
    seeds = list(range(len(prompts)))

    def run():
        sync()
        started = time.perf_counter()
        out = engine.generate(prompts, n=answers, temperature=1.0, max_tokens=tokens, min_tokens=tokens, seeds=seeds)
        sync()
        return out, time.perf_counter() - started

    try:
        for decoding in decodings:
            skips = graph_skips()
            try:
                engine.set_decoding(decoding)  # named, not auto: a failing path is its row, never a fallback
                with engine.turn():
                    _, first = run()
                    out, timed = run()
                    rows = [(p, r) for p, group in zip(prompts, out) for r in group][:CHECKED_ROWS]
                    gap = logprob_gap(
                        engine.model, [p for p, _ in rows], [r for _, r in rows], engine.stop_token_ids, tokens
                    )
                results[decoding] = {
                    "tokens_per_s": round(len(prompts) * answers * tokens / timed, 1),
                    "first_call_s": round(first, 2),
                    "timed_s": round(timed, 2),
                    "logprob_gap": gap,
                    "graph_skips": graph_skips() - skips,  # steps inductor ran without their CUDA graphs
                }
            except Exception as error:  # noqa: BLE001 - one path's failure is that path's row, the others still run
                results[decoding] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        engine.set_decoding(requested)
    return results
