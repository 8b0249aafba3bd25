"""Evaluation harness: metrics by hand, benchmark reading and grouping, gold grading, tables."""

import json
import math
import re
from pathlib import Path

import pytest

from trapo.algorithm.pass_at_k import avg_at_k, mean_pass_at_k, pass_at_k
from trapo.commands.eval import markdown_table
from trapo.data import DataError, read_benchmark_file, resolve_benchmarks
from trapo.training.evaluation import grade_responses


def test_avg_at_k_by_hand():
    grades = [[True, False, False, True], [False] * 4, [True] * 4]
    assert avg_at_k(grades) == pytest.approx((0.5 + 0 + 1) / 3)
    assert avg_at_k([[True], [False], [True], [True]]) == 0.75  # k = 1: pass@1


def test_pass_at_k_unbiased_by_hand():
    # n = 4 samples, c = 1 correct: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n - c < k
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 = c / n
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    grades = [[True, False, False, False], [True, True, False, False]]
    assert mean_pass_at_k(grades, 2) == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    with pytest.raises(ValueError, match="at least 8 samples"):
        pass_at_k(4, 1, 8)


def test_math_file_splits_by_source_and_groups_repeats(benchmarks_dir):
    benches = {b.name: b for b in read_benchmark_file(Path(benchmarks_dir) / "math.parquet")}
    sizes = {name: len(b.questions) for name, b in benches.items()}
    # AIME and AMC rows repeat each question 8 times: one question each
    assert sizes == {"math": 500, "olympiad_bench": 675, "minerva": 272, "aime": 30, "amc": 83, "aime25": 30}
    assert len({q.uid for q in benches["aime"].questions}) == 30


def test_every_shipped_gold_boxed_grades_correct_and_wrong_ones_do_not(benchmarks_dir):
    for f in ("math.parquet", "arc_c.parquet", "gpqa.parquet"):
        for bench in read_benchmark_file(Path(benchmarks_dir) / f):
            golds = [q.answer for q in bench.questions]
            right = [grade_responses([f"so \\boxed{{{g}}}"], g)[0] for g in golds]
            assert all(r["correct"] for r in right), (bench.name, [g for g, r in zip(golds, right) if not r["correct"]])
    arc = read_benchmark_file(Path(benchmarks_dir) / "arc_c.parquet")[0].questions[0]
    wrong_letter = next(x for x in "ABCD" if x != arc.answer)
    assert not grade_responses([f"\\boxed{{{wrong_letter}}}"], arc.answer)[0]["correct"]
    assert not grade_responses(["\\boxed{43}"], "42")[0]["correct"]
    assert grade_responses(["no box"], "42")[0] == {"answer": None, "correct": False}


def test_resolve_names_and_errors(tmp_path, benchmarks_dir):
    names = [b.name for b in resolve_benchmarks("aime,gpqa", Path(benchmarks_dir))]
    assert names == ["aime", "gpqa"]
    with pytest.raises(DataError, match="benchmark 'nope': no nope.parquet/.jsonl in"):
        resolve_benchmarks("nope", tmp_path)
    bad = tmp_path / "clash.jsonl"
    bad.write_text(
        json.dumps({"id": 1, "question": "q", "answer": "1"})
        + "\n"
        + json.dumps({"id": 2, "question": "q", "answer": "2"})
        + "\n"
    )
    with pytest.raises(DataError, match="clash.jsonl line 2: repeats the prompt of .* with a different answer"):
        resolve_benchmarks(str(bad), tmp_path)


def test_table_is_laid_out_like_table_1():
    res = {
        "gpqa": {"score": 0.25, "metrics": {"avg@1": 0.25}},
        "aime": {"score": 0.1, "metrics": {"avg@32": 0.1}},
        "math": {"score": 0.5, "metrics": {"avg@1": 0.5}},
        "toy": {"score": 0.75, "metrics": {"avg@1": 0.75}},
    }
    table = markdown_table(res, "m")
    header, _, row = table.splitlines()[:3]
    assert header == "| Model | AIME24 | MATH-500 | ID Avg. | GPQA* | OOD Avg. | toy |"
    assert row == "| m | 10.0 | 50.0 | 30.0 | 25.0 | 25.0 | 75.0 |"
    assert "AIME24 avg@32" in table


def test_one_progress_bar_per_benchmark_counts_what_is_left_and_samples_per_second(tty):
    from trapo.commands.eval import BenchmarkBars
    from trapo.data import Benchmark, Question

    qs = [Question(f"q{i}", "1+1?", "2", True, None, "here") for i in range(3)]
    benchmarks = [Benchmark("math", qs, "math.parquet"), Benchmark("gpqa", qs[:2], "gpqa.parquet")]
    done = {("math", "q0"): {}}  # finished earlier: not counted again
    with BenchmarkBars(benchmarks, done, n_for=lambda name: 4, enabled=True) as bars:
        for name in ("math", "math", "gpqa", "gpqa"):
            bars.advance(name)
    assert "math: 100%" in tty.text and "2/2" in tty.text and "gpqa: 100%" in tty.text
    assert "samples/s" in tty.text
    tty.text = ""
    with BenchmarkBars(benchmarks, done, n_for=lambda name: 4, enabled=False) as bars:  # --no-progress
        bars.advance("math")
    assert tty.text == ""


def test_arguments_and_weights_are_checked_before_the_engine_starts(tmp_path):
    """What vLLM would reject after loading, and a truncated weight file, named by flag or file in one line."""
    import argparse
    import struct
    import subprocess
    import sys

    from trapo import runtime
    from trapo.commands.eval import check_arguments

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    ok = dict(n=None, temperature=0.6, max_tokens=32, max_prompt_tokens=16, limit=None, hf_max_batch=8)
    check_arguments(argparse.Namespace(**ok), model)
    for change, needle in [({"n": 0}, "--n 0: samples per question must be >= 1"),
                           ({"temperature": -1.0}, "--temperature -1.0: must be in [0, 2]"),
                           ({"max_tokens": 60}, "--max-prompt-tokens 16 + --max-tokens 60 exceeds the 64 tokens"),
                           ({"limit": 0}, "--limit 0: must be >= 1")]:  # fmt: skip
        with pytest.raises(DataError, match=re.escape(needle)):
            check_arguments(argparse.Namespace(**{**ok, **change}), model)
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-4])
    with pytest.raises(DataError, match=r"model.safetensors: truncated \(\d+ of \d+ bytes\)"):
        check_arguments(argparse.Namespace(**ok), model)

    out = subprocess.run([sys.executable, "-m", "trapo", "eval", "--model", str(model), "--benchmarks", "math",
                          "--n", "0", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         env=runtime.subprocess_env(), cwd=runtime.ROOT, timeout=300)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and lines == ["trapo eval: --n 0: samples per question must be >= 1"], out.stderr
