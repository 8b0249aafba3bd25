"""Evaluation harness: metrics by hand, benchmark reading and grouping, gold grading, tables."""

import json
import math
import os
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
    ok = dict(n=None, temperature=0.6, max_tokens=32, max_prompt_tokens=None, limit=None, hf_max_batch=8)
    ok.update(grader_workers=2)
    ok.update(rope_theta=None, max_position_embeddings=None, pass_k=None, seed=0)
    check_arguments(argparse.Namespace(**ok), model)
    # a prompt cap no longer adds to the context check: the prompts are measured (engine_length)
    check_arguments(argparse.Namespace(**{**ok, "max_prompt_tokens": 60}), model)
    check_arguments(argparse.Namespace(**{**ok, "max_tokens": 64, "max_position_embeddings": 128}), model)
    for change, needle in [
        ({"n": 0}, "--n 0: samples per question must be >= 1"),
        ({"temperature": -1.0}, "--temperature -1.0: must be in [0, 2]"),
        (
            {"max_tokens": 64},
            "--max-tokens 64: leaves no room for a prompt in the 64 tokens the "
            "model serves (max_position_embeddings in its config.json)",
        ),
        (
            {"max_tokens": 64, "max_position_embeddings": 64},
            "in the 64 tokens the model serves (--max-position-embeddings)",
        ),
        ({"rope_theta": 0.0}, "--rope-theta 0.0: must be a finite number > 0"),
        ({"max_position_embeddings": 0}, "--max-position-embeddings 0: must be >= 1"),
        ({"limit": 0}, "--limit 0: must be >= 1"),
    ]:
        with pytest.raises(DataError, match=re.escape(needle)):
            check_arguments(argparse.Namespace(**{**ok, **change}), model)
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-4])
    with pytest.raises(DataError, match=r"model.safetensors: truncated \(\d+ of \d+ bytes\)"):
        check_arguments(argparse.Namespace(**ok), model)

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trapo",
            "eval",
            "--model",
            str(model),
            "--benchmarks",
            "math",
            "--n",
            "0",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=runtime.subprocess_env(),
        cwd=runtime.ROOT,
        timeout=300,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and lines == ["trapo eval: --n 0: samples per question must be >= 1"], out.stderr


def test_help_shows_the_rope_and_context_flags(capsys):
    from trapo.commands.eval import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "--rope-theta" in out and "--max-position-embeddings" in out and "--max-prompt-tokens" in out


def tiny_model(path: Path, max_position_embeddings: int) -> Path:
    """The toy's shape (trapo/commands/toy.py), untrained, with a context of `max_position_embeddings`."""
    from trapo.commands.toy import _model, _tokenizer

    tok = _tokenizer([f"{a}+{b}=\\boxed{{{a + b}}}" for a in range(10, 30) for b in range(10, 30)])
    model = _model(tok, seed=0)
    model.config.max_position_embeddings = max_position_embeddings
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def sums_benchmark(path: Path, n: int = 3) -> Path:
    rows = [{"id": i, "question": f"{11 + i}+{12 + i}=", "answer": str(23 + 2 * i)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.toy_run
def test_a_2048_token_model_is_evaluated_with_a_short_response_budget(tmp_path):
    """The prompt budget is the longest prompt, not a 2,048-token default: --max-tokens 8 fits a 2,048-token
    model; a budget past it is refused in one line naming the longest prompt, before the engine loads."""
    import sys

    import toyrun

    model = tiny_model(tmp_path / "m", 2048)
    bench = sums_benchmark(tmp_path / "sums.jsonl")
    common = ["-m", "trapo", "eval", "--model", str(model), "--benchmarks", str(bench), "--backend", "hf"]
    common += ["--n", "1", "--temperature", "0", "--template", "plain", "--no-progress"]

    def run(*more):  # forked from the worker's fork server, as a toy run (tests/toyrun.py)
        return toyrun.run([sys.executable, *common, *more], timeout=300)

    out = run("--max-tokens", "8", "--out", str(tmp_path / "ok"))
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "ok" / "results.json").read_text())["results"]["sums"]
    assert results["questions"] == 3 and results["tokens_generated"] <= 3 * 8
    lines = [json.loads(x) for x in (tmp_path / "ok" / "samples.jsonl").read_text().splitlines()]
    assert [len(r["responses"]) for r in lines] == [1, 1, 1]

    out = run("--max-tokens", "2045", "--out", str(tmp_path / "long"))  # 6 prompt tokens + 2045 > 2048
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert re.fullmatch(
        r"trapo eval: --max-tokens 2045 \+ the longest prompt's 6 tokens \(.*sums.jsonl line \d\) exceeds the 2048 "
        r"tokens the model serves \(max_position_embeddings in its config.json\); lower --max-tokens to 2042, or "
        r"extend the context with --max-position-embeddings and --rope-theta .*",
        lines[0],
    ), lines[0]
    assert not (tmp_path / "long" / "samples.jsonl").exists()  # stopped before the engine: nothing generated


def test_a_prompt_cap_refuses_a_longer_prompt_by_its_flag(tmp_path):
    from transformers import AutoTokenizer

    from trapo.training.evaluation import pending_prompts

    model = tiny_model(tmp_path / "m", 64)
    benchmarks = read_benchmark_file(sums_benchmark(tmp_path / "sums.jsonl"))
    tok = AutoTokenizer.from_pretrained(model)
    done = {("sums", benchmarks[0].questions[1].uid): {}}  # finished earlier: not measured again
    prompts = pending_prompts(tok, benchmarks, template="plain", max_prompt_tokens=None, done=done)
    assert [len(p) for p in prompts["sums"]] == [6, 6]
    with pytest.raises(DataError, match=r"sums.jsonl line 1: prompt has 6 tokens, over --max-prompt-tokens=5"):
        pending_prompts(tok, benchmarks, template="plain", max_prompt_tokens=5, key="--max-prompt-tokens")


def rope_theta_of(model) -> float:
    """The theta a transformers model's rotary embedding was built with, read off its inverse frequencies."""
    inv_freq = next(m for m in model.modules() if hasattr(m, "inv_freq")).inv_freq.double()
    half = inv_freq.numel()
    return float(inv_freq[-1] ** (-half / (half - 1)))


def test_rope_theta_and_positions_reach_the_hf_backend(tmp_path):
    import argparse

    from transformers import AutoTokenizer

    from trapo.commands.eval import engine_settings
    from trapo.engine.rollout_engine import open_engine

    model = tiny_model(tmp_path / "m", 64)
    tok = AutoTokenizer.from_pretrained(model)
    args = dict(
        backend="hf",
        dtype="float32",
        hf_max_batch=4,
        hf_decoding="auto",
        seed=0,
        rope_theta=None,
        max_position_embeddings=None,
    )

    def engine(max_model_len: int):
        settings = engine_settings(argparse.Namespace(**args), model, max_model_len)
        return open_engine(settings, str(model), tokenizer=tok, stop_token_ids=[tok.eos_token_id])

    plain = engine(32).model
    assert plain.config.max_position_embeddings == 64 and rope_theta_of(plain) == pytest.approx(10000.0)
    args.update(rope_theta=40000.0, max_position_embeddings=128)
    extended = engine(160).model
    assert extended.config.max_position_embeddings == 128 and rope_theta_of(extended) == pytest.approx(40000.0)


@pytest.mark.toy_run
def test_rope_theta_and_positions_reach_the_vllm_backend(tmp_path):
    """vLLM serves 100 tokens of a 64-token model only when --max-position-embeddings reached it; the theta is
    read off its rotary layer."""
    import sys

    import toyrun

    model = tiny_model(tmp_path / "m", 64)
    script = (
        "import argparse, json, sys\n"
        "from trapo import runtime\n"
        "runtime.configure()\n"
        "from transformers import AutoTokenizer\n"
        "from trapo.commands.eval import engine_settings\n"
        "from trapo.engine.rollout_engine import open_engine\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "args = argparse.Namespace(backend='vllm', dtype='float32', seed=0, rope_theta=40000.0,\n"
        "                          max_position_embeddings=128, hf_max_batch=256, hf_decoding='auto')\n"
        "settings = engine_settings(args, sys.argv[1], 100)\n"
        "engine = open_engine(settings, sys.argv[1], tokenizer=tok, stop_token_ids=[tok.eos_token_id])\n"
        "print('CONFIG', json.dumps(engine.effective_config()))\n"
    )
    (tmp_path / "engine_config.py").write_text(script)
    out = toyrun.run([sys.executable, str(tmp_path / "engine_config.py"), str(model)], timeout=300)  # forked
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("CONFIG ")).removeprefix("CONFIG "))
    assert config["rope_theta"] == pytest.approx(40000.0) and config["max_position_embeddings"] == 128


def test_every_numeric_flag_is_checked_before_the_model_is_fetched():
    """Each flag out of range is one line naming the flag, its value and what it takes; the run stops before
    the model is fetched (here a hub id that does not exist: the flag is named, not the model)."""
    import argparse
    import subprocess
    import sys

    from trapo import runtime
    from trapo.commands.eval import check_flags

    ok = dict(n=4, temperature=0.6, max_tokens=32, max_prompt_tokens=None, limit=None, hf_max_batch=8, grader_workers=2)
    ok.update(rope_theta=None, max_position_embeddings=None, pass_k=4, seed=0)
    check_flags(argparse.Namespace(**ok))
    check_flags(argparse.Namespace(**{**ok, "n": None, "pass_k": 2}))  # the benchmarks' n is checked later
    cases = [
        ({"pass_k": -1}, "--pass-k -1: pass@k needs 1 <= k <= --n (4), the samples per question"),
        ({"pass_k": 0}, "--pass-k 0: pass@k needs 1 <= k <= --n (4)"),
        ({"pass_k": 5}, "--pass-k 5: pass@k needs 1 <= k <= --n (4)"),
        ({"n": -2}, "--n -2: samples per question must be >= 1"),
        ({"temperature": float("nan")}, "--temperature nan: must be in [0, 2]"),
        ({"temperature": 2.5}, "--temperature 2.5: must be in [0, 2]"),
        ({"temperature": 0.0}, "--temperature 0 (greedy) gives one sample per question; --n 4 asks for more"),
        ({"max_tokens": 0}, "--max-tokens 0: must be >= 1"),
        ({"max_prompt_tokens": -5}, "--max-prompt-tokens -5: must be >= 1"),
        ({"max_position_embeddings": 0}, "--max-position-embeddings 0: must be >= 1"),
        ({"limit": -1}, "--limit -1: must be >= 1"),
        ({"grader_workers": 0}, "--grader-workers 0: must be >= 1"),
        ({"hf_max_batch": 0}, "--hf-max-batch 0: must be >= 1"),
        ({"rope_theta": float("inf")}, "--rope-theta inf: must be a finite number > 0"),
        ({"rope_theta": -1.0}, "--rope-theta -1.0: must be a finite number > 0"),
        ({"seed": -1}, "--seed -1: must be in [0, 4294967295]"),
        ({"seed": 2**32}, "--seed 4294967296: must be in [0, 4294967295]"),
    ]
    for change, needle in cases:
        with pytest.raises(DataError, match=re.escape(needle)):
            check_flags(argparse.Namespace(**{**ok, **change}))

    cmd = [sys.executable, "-m", "trapo", "eval", "--model", "no-such-org/no-such-model", "--benchmarks", "math"]
    cmd += ["--pass-k", "-1"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=runtime.subprocess_env(), cwd=runtime.ROOT, timeout=300
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    expected = "trapo eval: --pass-k -1: pass@k needs 1 <= k <= --n, the samples per question"
    assert out.returncode == 2 and lines == [expected], out.stderr


def eval_until_the_engine(model: Path, *flags: str):
    """`trapo eval --backend hf` on `model` with the engine's factory replaced by one that fails: what the run
    says before any engine loads, then 'the engine was opened' if it got that far."""
    import sys
    import tempfile

    import toyrun

    script = (
        "import sys\n"
        "from trapo import runtime\n"
        "runtime.configure()\n"
        "from trapo.engine import rollout_engine\n"
        "def refuse(*args, **kwargs):\n"
        "    raise RuntimeError('the engine was opened')\n"
        "rollout_engine.open_engine = refuse\n"
        "from trapo.commands.eval import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    with tempfile.TemporaryDirectory() as folder:  # a script, forked from a pre-imported parent (tests/toyrun.py)
        path = os.path.join(folder, "eval_until_the_engine.py")
        with open(path, "w") as f:
            f.write(script)
        flags = ["--model", str(model), "--backend", "hf", "--template", "plain", *flags]
        out = toyrun.run([sys.executable, path, *flags], timeout=300)
    return out.returncode, [line for line in out.stderr.splitlines() if line.strip()]


def test_a_prompt_over_max_prompt_tokens_and_a_pass_k_over_the_benchmarks_n_stop_before_any_engine_loads(tmp_path):
    model = tiny_model(tmp_path / "m", 64)
    bench = sums_benchmark(tmp_path / "sums.jsonl")
    common = ["--benchmarks", str(bench), "--max-tokens", "8", "--no-progress"]
    rc, lines = eval_until_the_engine(model, *common, "--max-prompt-tokens", "5", "--out", str(tmp_path / "a"))
    assert rc == 2 and len(lines) == 1, lines
    assert re.fullmatch(
        r"trapo eval: .*sums.jsonl line 1: prompt has 6 tokens, over --max-prompt-tokens=5", lines[0]
    ), lines
    assert not (tmp_path / "a" / "samples.jsonl").exists()

    rc, lines = eval_until_the_engine(model, *common, "--pass-k", "2", "--out", str(tmp_path / "b"))  # n: 1
    expected = (
        "trapo eval: --pass-k 2: pass@k needs 1 <= k <= the samples per question; sums takes 1 by the paper's "
        "protocol: add --n 2"
    )
    assert rc == 2 and lines == [expected], lines

    rc, lines = eval_until_the_engine(model, *common, "--max-prompt-tokens", "6", "--out", str(tmp_path / "c"))
    assert rc == 1 and len(lines) == 1 and "RuntimeError: the engine was opened" in lines[0], lines  # it fits


def test_prose_golds_are_counted_and_warned_once_per_file_before_generation(tmp_path):
    """A gold that is prose scores 0 (training refuses such rows): one line naming the file, how many and the
    first row, before the engine loads; the run goes on."""
    from trapo.data import Benchmark, Question
    from trapo.training.evaluation import ungradable_golds

    model = tiny_model(tmp_path / "m", 64)
    rows = [{"id": i, "question": f"{11 + i}+{12 + i}=", "answer": str(23 + 2 * i)} for i in range(4)]
    rows[1]["answer"] = "see the solution above"
    rows[3]["answer"] = "the answer is in the text"
    bench = tmp_path / "prose.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--benchmarks", str(bench), "--max-tokens", "8", "--no-progress", "--out", str(tmp_path / "o")]
    rc, lines = eval_until_the_engine(model, *flags)
    assert rc == 1 and len(lines) == 2, lines
    assert re.fullmatch(
        rf"trapo eval: warning: {re.escape(str(bench))}: 2 of 4 questions have a gold that is prose, not a math "
        rf"answer or an option letter \(first: {re.escape(str(bench))} line 2, 'see the solution above'\); they "
        r"score 0 unless a response repeats the gold verbatim: fix or remove those rows",
        lines[0],
    ), lines
    assert "RuntimeError: the engine was opened" in lines[1]  # warned before, and the run went on

    ok = [Question(f"q{i}", "1+1?", g, True, None, f"a.jsonl line {i + 1}") for i, g in enumerate(["2", "B"])]
    assert ungradable_golds([Benchmark("a", ok, "a.jsonl")]) == []  # a number, an option letter: no warning


def test_the_verifier_flag_grades_with_it_and_a_missing_one_is_refused_before_the_model_is_fetched():
    import subprocess
    import sys

    from trapo import runtime
    from trapo.engine.grading.verifier import MathVerifier

    exact = MathVerifier(num_workers=1, spec="exact")
    try:  # exact strings: `ab c.` is `ab c`, `Ab` is not `ab`; Math-Verify would read neither
        graded = grade_responses(["\\boxed{ab c.}", "\\boxed{Ab c}", "no answer"], "ab c", verifier=exact)
    finally:
        exact.close()
    assert graded == [
        {"answer": "ab c.", "correct": True},
        {"answer": "Ab c", "correct": False},
        {"answer": None, "correct": False},
    ]
    cmd = [sys.executable, "-m", "trapo", "eval", "--model", "no-such-org/no-such-model", "--benchmarks", "math"]
    cmd += ["--verifier", "nosuchmodule:thing"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=runtime.subprocess_env(), cwd=runtime.ROOT, timeout=300
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("trapo eval: --verifier: no module named 'nosuchmodule'"), lines
