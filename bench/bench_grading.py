"""Grading + majority vote throughput: 64 questions x 8 rollouts = 512 responses.

Answers are drawn from MATH-500 gold answers in data/benchmarks:
per rollout, the question's gold (50%), the gold re-spelled (15%: spaces
around operators, \\dfrac, a trailing ".0" on integers) or one of two wrong answers taken from
other questions' golds (35%), so each question has a few distinct answers as
a sampled model would. Prints, side by side in one run:

- ours: `math_rewards` against the gold + `majority_votes`, fresh workers
  (empty parse caches), start-up excluded and printed apart;
- naive: Math-Verify parse + verify of every response against the gold, and
  a majority vote by pairwise verify of all 8 x 8 responses.
"""

import os
import random
import sys
import time
from collections import Counter

from trapo import runtime  # noqa: E402

runtime.configure()  # bounded threads before torch is imported

import pyarrow.parquet as pq  # noqa: E402

from trapo.algorithm.rewards import extract_answer, majority_votes, math_rewards  # noqa: E402
from trapo.data import benchmarks_dir  # noqa: E402
from trapo.engine.grading.verifier import MathVerifier  # noqa: E402

QUESTIONS, G, TARGET_S = 64, 8, 1.0
DATA = str(benchmarks_dir())


def respell(gold: str, rng: random.Random) -> str:
    """The same answer written differently: `12.0`, `\\dfrac`, spaces around operators."""
    if gold.isdigit():
        return gold + ".0"
    if "\\frac" in gold:
        return gold.replace("\\frac", "\\dfrac")
    return " ".join(gold.replace(",", " , ").replace("+", " + ").replace("=", " = ").split())


def make_batch(seed: int = 0, sample_seed: int | None = None) -> tuple[list[str], list[str]]:
    """Questions (and their two wrong answers) from `seed`; rollouts from `sample_seed` (default: seed)."""
    rows = pq.read_table(os.path.join(DATA, "math.parquet"), columns=["data_source", "reward_model"]).to_pylist()
    golds = sorted({r["reward_model"]["ground_truth"] for r in rows if r["data_source"] == "math"})
    rng = random.Random(seed)
    chosen = rng.sample(golds, QUESTIONS)
    responses, per_gold = [], []
    wrongs = [rng.sample([g for g in golds if g != gold], 2) for gold in chosen]
    rng = random.Random(seed if sample_seed is None else sample_seed)
    for gold, wrong in zip(chosen, wrongs):
        for _ in range(G):
            u = rng.random()
            answer = gold if u < 0.5 else respell(gold, rng) if u < 0.65 else rng.choice(wrong)
            responses.append(f"Let me work it out step by step ... so the answer is \\boxed{{{answer}}}.")
            per_gold.append(gold)
    return responses, per_gold


def ours(responses, golds, verifier):
    rewards = math_rewards(responses, golds, verifier)
    answers = [extract_answer(r) for r in responses]
    votes = majority_votes([answers[i : i + G] for i in range(0, len(answers), G)], verifier)
    return rewards, votes


def naive(responses, golds):
    from math_verify import parse, verify

    rewards, labels = [], []
    for q in range(0, len(responses), G):
        group = [parse(r) for r in responses[q : q + G]]
        gold = parse(f"\\boxed{{{golds[q]}}}")
        rewards += [1.0 if verify(gold, p) else 0.0 for p in group]
        support = [sum(verify(a, b) for b in group) for a in group]
        best = max(support)
        labels.append(None if Counter(support)[best] > best else support.index(best))
    return rewards, labels


def main() -> None:
    responses, golds = make_batch()
    print(f"grading {len(responses)} responses ({QUESTIONS} questions x {G}) + majority vote, MATH-500 golds")
    verifier = MathVerifier(num_workers=2)
    t0 = time.perf_counter()
    verifier.start()
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    rewards, votes = ours(responses, golds, verifier)
    ours_s = time.perf_counter() - t0
    # Steady state: the next epoch's rollouts for the same questions (new
    # samples, golds and earlier answers already parsed by the workers).
    responses2, golds2 = make_batch(seed=0, sample_seed=1)
    t0 = time.perf_counter()
    ours(responses2, golds2, verifier)
    ours2_s = time.perf_counter() - t0
    verifier.close()
    t0 = time.perf_counter()
    naive_rewards, _ = naive(responses, golds)
    naive_s = time.perf_counter() - t0
    agree = sum(a == b for a, b in zip(rewards, naive_rewards))
    labels = sum(v[0] is not None for v in votes)
    print(
        f"  ours  : {ours_s:6.3f} s  ({verifier.num_workers} workers; their start-up, excluded: {startup:.2f} s)"
        f"  target {TARGET_S:.1f} s  ratio {ours_s / TARGET_S:.2f} of target"
    )
    print(
        f"  ours, next epoch (same questions, warm parse caches): {ours2_s:6.3f} s  "
        f"ratio {ours2_s / TARGET_S:.2f} of target"
    )
    print(f"  naive : {naive_s:6.3f} s  (pairwise Math-Verify vote)")
    print(
        f"  speed-up {naive_s / ours_s:.1f}x; rewards agree on {agree}/{len(rewards)}; "
        f"mean reward {sum(rewards) / len(rewards):.3f}; labels found {labels}/{QUESTIONS}"
    )
    sys.exit(0 if agree == len(rewards) else 1)


if __name__ == "__main__":
    main()
