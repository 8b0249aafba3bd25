"""Cleaning prepare's rows: golds the reward can use, duplicates, evaluation questions (exact and by n-gram),
and prompts over the token limit. Pure but for the gold check, which runs Math-Verify (in worker processes
for large sources)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from trapo.commands.prepare.sources import Row, source_files
from trapo.data import DataError, gold_problem, jsonl_rows, parquet_rows

# Decontamination n-gram length, in words. Measured on the shipped evaluation sets (1590 distinct
# math questions; bench/bench_decontam.py prints the table): questions sharing an n-gram with a
# *different* question number 491 at n = 8 (stock phrasing such as "the final answer can be written in
# the form"), 324 at n = 10 and 246 at n = 13, after which the count flattens (224 at 16, 177 at 20):
# what two distinct questions still share at 13 words is mostly one problem's common statement
# (OlympiadBench's multi-part problems, Minerva's preambles), which a training question should not
# copy either. 13 is also the length of GPT-3's and lm-evaluation-harness's contamination checks;
# open-r1's script uses 8, which on these sets flags twice as many questions for shared boilerplate.
NGRAM = 13
REASONS = ("gold_unusable", "duplicate", "contaminated_exact", "contaminated_ngram", "prompt_too_long")


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def dedup_key(text: str) -> str:
    return " ".join(text.lower().split())


class Contamination:
    """Evaluation questions, by their word sequence and by every NGRAM-word window of it."""

    def __init__(self, questions: list[str], n: int = NGRAM):
        self.n = n
        self.exact = {" ".join(words(q)) for q in questions}
        self.grams = {g for q in questions for g in self._grams(words(q))}

    def _grams(self, w: list[str]) -> set[tuple[str, ...]]:
        return {tuple(w[i : i + self.n]) for i in range(len(w) - self.n + 1)}

    def check(self, question: str) -> str | None:
        """'contaminated_exact', 'contaminated_ngram' or None."""
        w = words(question)
        if " ".join(w) in self.exact:
            return "contaminated_exact"
        return "contaminated_ngram" if not self.grams.isdisjoint(self._grams(w)) else None

    @classmethod
    def from_dirs(cls, dirs: list[str]) -> tuple[Contamination, list[Path]]:
        files = []
        for d in dirs:
            path = Path(d)
            if not path.exists():
                raise DataError(f"--exclude {path}: not found (a folder of evaluation parquet/JSONL files)")
            files += source_files(d)
        questions = []
        for f in files:
            questions += [q.question for q in (parquet_rows(f) if f.suffix == ".parquet" else jsonl_rows(f))]
        return cls(questions), files


def _gold_check(gold: str) -> bool:
    from math_verify import parse

    from trapo.algorithm.rewards import extract_boxed

    boxed = "\\boxed{" + gold + "}"
    try:
        return extract_boxed(boxed) == gold and bool(parse(boxed, parsing_timeout=5))
    except Exception:  # noqa: BLE001 - Math-Verify raises many types on odd LaTeX; any of them means unusable
        return False


def stage(bar, name: str, total: int) -> None:
    """Point a file's progress bar (described "FILE: stage") at its next stage of `total` items."""
    if bar is not None and not bar.disable:
        bar.reset(total=total)
        bar.set_description_str(f"{bar.desc.rpartition(': ')[0]}: {name}", refresh=False)


def usable_golds(golds: list[str], workers: int, bar=None) -> list[bool]:
    """Each gold is non-empty and parses under Math-Verify as the reward parses it (in `\\boxed{}`).
    `bar` (a progress bar) is reset to the distinct golds and advanced as they are checked."""
    todo = sorted({g for g in golds if g.strip()})
    stage(bar, "golds", len(todo))
    tick = bar.update if bar is not None else lambda n: None
    if workers > 1 and len(todo) > 2000:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            checked = []
            for good in pool.imap(_gold_check, todo, chunksize=256):  # in order, as map, but one at a time
                checked.append(good)
                tick(1)
            ok = dict(zip(todo, checked))
    else:
        ok = {}
        for g in todo:
            ok[g] = _gold_check(g)
            tick(1)
    return [bool(g.strip()) and ok[g] and gold_problem(g) is None for g in golds]


def clean(
    rows: list[Row], contamination: Contamination, too_long, counts: Counter, workers: int, seen: set[str], bar=None
):
    """The rows that pass every check, in input order; `counts` gains one per dropped row and reason.

    `seen` holds the dedup keys already kept (shared between the labeled and the OOD pool, and across
    sources); `too_long(row) -> bool` is the tokenizer check (or always False); `bar`, a progress bar,
    counts the golds checked, then the rows."""
    ok_gold = usable_golds([r.answer for r in rows], workers, bar)
    stage(bar, "rows", len(rows))
    kept = []
    for row, good in zip(rows, ok_gold):
        if bar is not None:
            bar.update(1)
        key = dedup_key(row.question)
        reason = (
            "gold_unusable"
            if not good
            else "duplicate"
            if key in seen
            else contamination.check(row.question) or ("prompt_too_long" if too_long(row) else None)
        )
        if reason:
            counts[reason] += 1
            continue
        seen.add(key)
        kept.append(row)
    return kept
