"""trapo word-problems: each story's gold re-derived from its text, the splits disjoint and in their mixes,
written through trapo prepare into files the trainer reads."""

import json
import re

import pytest

from trapo.commands import word_problems as wp
from trapo.data import load_questions, read_benchmark_file

NUMBER = r"(\d+)"


def solve(question: str) -> tuple[int, int]:
    """(the answer, the number of operations) read back from the text alone, phrase by phrase: an independent
    check of the generator's arithmetic."""
    value, steps = None, 0
    for sentence in re.split(r"(?<=[.?])\s+", question):
        numbers = [int(n) for n in re.findall(NUMBER, sentence)]
        s = sentence.lower()
        if value is None:
            if " each" in s:  # a box start: count x per box
                value, steps = numbers[0] * numbers[1], 1
            else:
                value = numbers[0]
        elif "times" in s:
            value, steps = value * numbers[0], steps + 1
        elif "more" in s:
            value, steps = value + numbers[0], steps + 1
        elif any(w in s for w in ("gives", "loses", "uses")):
            value, steps = value - numbers[0], steps + 1
        elif any(w in s for w in ("equally", "equal piles")):
            assert value % numbers[0] == 0, question
            value, steps = value // numbers[0], steps + 1
        else:
            assert s.startswith(("how many", "what is")), sentence
    return value, steps


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("range_name", ["tiny", "small", "medium"])
def test_every_gold_is_the_story_solved_and_counts_stay_whole(steps, range_name):
    drawn = wp.problems(3, 60, steps, range_name)
    assert len({p.question for p in drawn}) == 60
    lo, hi = wp.RANGES[range_name]
    for p in drawn:
        assert solve(p.question) == (p.answer, steps), p.question
        assert p.answer >= 0 and p.steps == steps and p.range == range_name
        assert p.question[0].isupper() and all(s[0].isupper() for s in re.split(r"(?<=[.?])\s+", p.question))


def test_the_same_arguments_give_the_same_problems_and_others_differ():
    assert wp.problems(0, 20, 2, "small") == wp.problems(0, 20, 2, "small")
    assert wp.problems(0, 20, 2, "small") != wp.problems(1, 20, 2, "small")


def test_counts_split_a_mix_exactly():
    assert wp.counts({(1, "a"): 0.5, (2, "a"): 0.5}, 5) in ({(1, "a"): 3, (2, "a"): 2}, {(1, "a"): 2, (2, "a"): 3})
    assert sum(wp.counts(wp.IN_DOMAIN, 97).values()) == 97


def test_splits_are_disjoint_and_each_in_its_mix():
    sizes = {"train": 40, "validation": 20, "test": 30, "test_ood": 20}
    drawn = wp.splits(0, sizes)
    seen = [p.question for rows in drawn.values() for p in rows]
    assert len(seen) == len(set(seen)) == sum(sizes.values())
    for name, rows in drawn.items():
        mix = wp.OUT_OF_DOMAIN if name == "test_ood" else wp.IN_DOMAIN
        cells = {}
        for p in rows:
            cells[(p.steps, p.range)] = cells.get((p.steps, p.range), 0) + 1
        assert cells == {c: n for c, n in wp.counts(mix, sizes[name]).items() if n}


def test_the_command_writes_prepared_splits_the_trainer_reads(tmp_path):
    out = tmp_path / "wp"
    assert (
        wp.main(
            ["--out", str(out), "--train", "20", "--labeled", "5", "--validation", "6", "--test", "8", "--ood", "6"]
        )
        == 0
    )
    train = load_questions([str(out / "train.parquet")])
    assert len(train) == 20 and sum(q.labeled for q in train) == 5
    assert all(q.answer is not None for q in train)  # unlabeled rows keep their hidden gold
    assert all(q.messages[:-1] == tuple((m["role"], m["content"]) for m in wp.PROMPT[:-1]) for q in train)
    assert all(q.messages[-1] == ("user", q.question) for q in train)
    problems = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    gold = {p["question"]: str(p["answer"]) for p in problems}
    for name, n in (("validation", 6), ("test", 8), ("test_ood", 6)):
        (bench,) = read_benchmark_file(out / f"{name}.parquet")
        assert len(bench.questions) == n and all(gold[q.question] == q.answer for q in bench.questions)
        manifest = json.loads((out / f"{name}.parquet.manifest.json").read_text())
        assert manifest["counts"]["kept"] == n and str(tmp_path / "wp" / "prompt.json") in manifest["command"]
        assert ".partial-" not in json.dumps(manifest)
    before = (out / "train.parquet").stat().st_mtime_ns
    assert (
        wp.main(
            ["--out", str(out), "--train", "20", "--labeled", "5", "--validation", "6", "--test", "8", "--ood", "6"]
        )
        == 0
    )
    assert (out / "train.parquet").stat().st_mtime_ns == before  # complete and the same options: kept
    assert wp.main(["--out", str(out), "--train", "21", "--labeled", "5"]) == 2  # other options: refused
    assert [p.name for p in tmp_path.iterdir()] == ["wp"]  # no scratch folder left
