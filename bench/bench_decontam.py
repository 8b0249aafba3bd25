"""The evidence behind trapo.commands.prepare's decontamination n-gram length (NGRAM).

For n words, counts the distinct math questions of data/benchmarks (AIME, AMC, MATH-500,
Minerva, OlympiadBench) that share an n-word run with a *different* question. A short n
flags questions for stock phrasing ("the final answer can be written in the form ..."); a
long n misses a training question that copies most of a problem. Also times the check of
45,000 training-sized questions against every evaluation set.
Run: make bench (or .venv/bin/python bench/bench_decontam.py).
"""

import random
import time
from collections import defaultdict

from trapo.commands.prepare.cleaning import NGRAM, Contamination, words
from trapo.commands.prepare.sources import source_files
from trapo.data import benchmarks_dir, parquet_rows


def shared_counts(questions: list[str], sizes: list[int]) -> dict[int, int]:
    out = {}
    for n in sizes:
        owners = defaultdict(set)
        for i, q in enumerate(questions):
            w = words(q)
            for j in range(len(w) - n + 1):
                owners[tuple(w[j : j + n])].add(i)
        out[n] = len({i for s in owners.values() if len(s) > 1 for i in s})
    return out


def main() -> None:
    math_file = benchmarks_dir() / "math.parquet"
    distinct = {" ".join(words(q.question)): q.question for q in parquet_rows(math_file)}
    questions = list(distinct.values())
    print(f"{len(questions)} distinct math questions in {math_file}")
    print("n-gram  questions sharing one with another question")
    for n, count in shared_counts(questions, [6, 8, 10, 13, 16, 20, 30]).items():
        print(f"{n:>6}  {count:>5}  ({count / len(questions):.1%}){'   <- NGRAM' if n == NGRAM else ''}")

    all_questions = [q.question for f in source_files(str(benchmarks_dir())) for q in parquet_rows(f)]
    t0 = time.perf_counter()
    check = Contamination(all_questions)
    built = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = sorted({w for q in questions for w in words(q)})
    train = [" ".join(rng.choice(vocab) for _ in range(60)) for _ in range(45_000)]
    t0 = time.perf_counter()
    flagged = sum(check.check(q) is not None for q in train)
    per = (time.perf_counter() - t0) / len(train)
    print(
        f"index of {len(all_questions)} evaluation rows: {built:.2f} s; check: {per * 1e6:.0f} us per 60-word question "
        f"({per * 45_000:.1f} s for 45K; {flagged} random-word questions flagged)"
    )


if __name__ == "__main__":
    main()
