"""The generated blocks of README.md and docs/ are rewritten from outputs, never typed in."""

import json
import re
import shutil

import pytest

from trapo.commands import readme


def test_replace_block_and_missing_markers():
    text = "intro\n<!-- generated:x -->\nold\nlines\n<!-- /generated:x -->\noutro\n"
    assert (
        readme.replace_block(text, "x", "new\n") == "intro\n<!-- generated:x -->\nnew\n<!-- /generated:x -->\noutro\n"
    )
    with pytest.raises(ValueError, match="no block 'y'"):
        readme.replace_block(text, "y", "z")


def test_make_train_block_from_a_run(tmp_path):
    run = tmp_path / "toy"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 3, "heldout_accuracy_after": 0.5, "selection": None}))
    target = tmp_path / "README.md"
    target.write_text("<!-- generated:make-train -->\n<!-- /generated:make-train -->\n")
    assert readme.main(["--train", str(run), "--readme", str(target)]) == 0
    assert "trained 3 steps\nheld-out accuracy after: 0.500" in target.read_text()
    assert readme.main(["--train", str(tmp_path / "none"), "--readme", str(target)]) == 2  # no summary.json
    # a run that recorded its CPU kernel set: the block says which one produced it
    (run / "summary.json").write_text(json.dumps({"steps": 3, "heldout_accuracy_after": 0.5, "cpu_kernels": "AVX2"}))
    assert readme.main(["--train", str(run), "--readme", str(target)]) == 0
    assert target.read_text() == (
        "<!-- generated:make-train -->\nWith torch's AVX2 CPU kernels (`torch.backends.cpu.get_cpu_capability()`):\n\n"
        "```\ntrained 3 steps\nheld-out accuracy after: 0.500\n```\n<!-- /generated:make-train -->\n"
    )


def test_make_train_block_holds_each_kernel_sets_run_once_and_their_largest_difference(tmp_path):
    runs = []
    for name, kernels, greedy, avg in (
        ("a", "AVX512", (0.9, 0.8), (0.7, 0.9)),
        ("b", "AVX2", (0.95, 0.9), (0.75, 0.96)),
    ):
        run = tmp_path / name
        run.mkdir()
        summary = {"steps": 2, "cpu_kernels": kernels, "heldout_temperature": 0.0, "selection": None}
        summary.update(heldout_accuracy_before=greedy[0], heldout_accuracy_after=greedy[1])
        summary.update(heldout_avg={"k": 8, "temperature": 0.6}, heldout_avg_before=avg[0], heldout_avg_after=avg[1])
        (run / "summary.json").write_text(json.dumps(summary))
        runs.append(str(run))
    target = tmp_path / "README.md"
    target.write_text("<!-- generated:make-train -->\n<!-- /generated:make-train -->\n")
    assert readme.main(["--train", *runs, runs[0], "--readme", str(target)]) == 0  # AVX512 twice: shown once
    text = target.read_text()
    assert text.count("With torch's AVX512") == 1 and text.count("With torch's AVX2") == 1
    assert text.index("AVX512") < text.index("AVX2 CPU") and text.count("held-out avg@8 (temperature 0.6)") == 2
    # |0.9 - 0.95|, |0.8 - 0.9|, |0.7 - 0.75|, |0.9 - 0.96|
    assert "Largest difference between these kernel sets: greedy before 0.050, greedy after 0.100, " in text
    assert "avg@k before 0.050, avg@k after 0.060.\n<!-- /generated:make-train -->" in text


def test_make_test_block_from_pytests_junit_report(tmp_path):
    report = tmp_path / "make-test.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1" '
        'skipped="4" tests="470" time="583.4" timestamp="2026-11-25T14:00:00"></testsuite></testsuites>'
    )
    target = tmp_path / "README.md"
    target.write_text("before\n<!-- generated:make-test -->\nold\n<!-- /generated:make-test -->\nafter\n")
    assert readme.main(["--test", str(report), "--file", str(target)]) == 0
    assert target.read_text() == (
        "before\n<!-- generated:make-test -->\n```\n$ make test\n"
        "465 passed, 4 skipped, 1 failed in 9:43 (two pytest-xdist workers)\n```\n"
        "<!-- /generated:make-test -->\nafter\n"
    )


def test_reproduce_block_rewrites_links_from_the_readme(tmp_path):
    docs = tmp_path / "docs" / "reproduce-toy"
    docs.mkdir(parents=True)
    (docs / "results.md").write_text("| a | b |\n\n![fig](figure4.png) [web](https://x.org/a.png) [s](#x)\n")
    (docs / "results.json").write_text(json.dumps({"minutes": 33.3}))
    target = tmp_path / "README.md"
    target.write_text("x\n<!-- generated:reproduce-toy -->\nold 0.602\n<!-- /generated:reproduce-toy -->\n")
    assert readme.main(["--reproduce", str(docs), "--readme", str(target)]) == 0
    text = target.read_text()
    assert "old 0.602" not in text and "took 33.3 min" in text
    assert "![fig](docs/reproduce-toy/figure4.png)" in text and "(https://x.org/a.png)" in text
    assert "[s](#x)" in text  # an anchor stays an anchor


def test_reproduce_block_links_point_from_its_docs_page(tmp_path):
    docs = tmp_path / "docs" / "reproduce-toy"
    docs.mkdir(parents=True)
    (docs / "results.md").write_text("![fig](figure4.png)\n")
    (docs / "results.json").write_text(json.dumps({"minutes": 1.0}))
    page = tmp_path / "docs" / "reproduce-toy.md"
    page.write_text("# toy\n<!-- generated:reproduce-toy -->\n<!-- /generated:reproduce-toy -->\n")
    assert readme.main(["--reproduce", str(docs), "--file", str(page)]) == 0
    assert "![fig](reproduce-toy/figure4.png)" in page.read_text()


def test_each_block_lives_in_its_own_file_and_holds_what_the_code_writes():
    assert readme.BLOCKS["make-train"] == readme.README
    for name, path in readme.BLOCKS.items():
        text = path.read_text()
        assert text.count(f"<!-- generated:{name} -->") == 1 and text.count(f"<!-- /generated:{name} -->") == 1, path
        others = [f for f in [readme.README, *sorted(readme.DOCS.glob("*.md"))] if f != path]
        assert not [f for f in others if f"<!-- generated:{name} -->" in f.read_text()], name
    # the reproduction's block, rebuilt from docs/reproduce-toy/ for its page, is the page's block as it is
    page = readme.BLOCKS["reproduce-toy"]
    body = readme.reproduce_block(readme.DOCS / "reproduce-toy", page)
    assert readme.replace_block(page.read_text(), "reproduce-toy", body) == page.read_text()


def test_a_missing_block_writes_nothing(tmp_path):
    run = tmp_path / "toy"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 3, "heldout_accuracy_after": 0.5, "selection": None}))
    target = tmp_path / "page.md"
    target.write_text("no markers here\n")
    assert readme.main(["--train", str(run), "--file", str(target)]) == 2
    assert target.read_text() == "no markers here\n"


def test_memory_plan_block_comes_from_the_doctor():
    body = readme.plan_block()
    assert body.count("memory plan: configs/trapo_1k_3k.yaml on 8 x") == 2
    assert "`python -m trapo doctor --plan --config configs/trapo_1k_3k.yaml --gpus 8 --gpu-memory-gb 141`" in body
    text = readme.BLOCKS["memory-plan"].read_text()
    assert readme.replace_block(text, "memory-plan", body) == text  # docs/memory-plan.md holds the current output


def _toolbox_rows() -> list[tuple[str, str]]:
    """(key, default) of each row of the toolbox table in docs/configuration.md."""
    import re

    text = (readme.DOCS / "configuration.md").read_text()
    start = text.index("<!-- toolbox-keys")
    table = text[start:].split("\n\n", 1)[0]
    return re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", table, flags=re.M)


def test_toolbox_table_names_real_keys_with_their_defaults():
    import dataclasses

    import yaml

    from trapo.config import Config

    rows = _toolbox_rows()
    assert len(rows) >= 14
    for key, default in rows:
        node = Config()
        for part in key.split("."):
            assert dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}, key
            node = getattr(node, part)
        assert yaml.safe_dump(node).removesuffix("...\n").strip() == default, (key, node)


def test_without_a_block_it_says_where_each_lives(capsys):
    assert readme.main([]) == 0
    out = capsys.readouterr().out
    assert "make-train: README.md" in out and "memory-plan: docs/memory-plan.md" in out
    assert "reproduce-toy: docs/reproduce-toy.md" in out


def test_bench_blocks_take_each_benchs_own_lines_and_need_some_output(tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "lora.txt").write_text(
        "toy: update, 2 ranks on CPU\nINFO 11-26 vllm engine started\nset-up  trainable\nfull  476,288  0.3\n"
        "[2026-11-26] [WARNING] accelerator\nlora-z3  38,912  0.3\n  merged   push 0.014 s\n  adapter  push 0.016 s\n"
    )
    target = tmp_path / "benchmarks.md"
    target.write_text("<!-- generated:bench-lora -->\n<!-- /generated:bench-lora -->\n")
    assert readme.main(["--bench", str(out), "--file", str(target)]) == 0  # no rollout outputs: that block is left
    body = target.read_text()
    assert "INFO" not in body and "WARNING" not in body
    assert "full  476,288" in body and "lora-z3" in body and "  adapter  push" in body and body.count("```") == 2
    assert readme.main(["--bench", str(tmp_path / "empty"), "--file", str(target)]) == 2


def test_bench_vote_block_is_the_benchs_saved_output(tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    printed = "vote over 64 mixed degenerate answers\n  set 0: vote 6.20 s, grading 5.30 s: 1.17x\n  worst 1.17x\n"
    (out / "vote.txt").write_text(printed)
    target = tmp_path / "benchmarks.md"
    target.write_text("before\n<!-- generated:bench-vote -->\nold\n<!-- /generated:bench-vote -->\nafter\n")
    assert readme.main(["--bench", str(out), "--file", str(target)]) == 0
    assert target.read_text() == (
        "before\n<!-- generated:bench-vote -->\n```\n" + printed + "```\n<!-- /generated:bench-vote -->\nafter\n"
    )


def test_the_real_model_blocks_come_from_the_eval_samples_and_the_run(tmp_path, monkeypatch):
    from trapo.commands.report import passrates

    evaluated = tmp_path / "eval"
    evaluated.mkdir()
    (evaluated / "run.json").write_text(
        json.dumps({"model": "/m/SmolLM2", "temperature": 0.7, "max_tokens": 48, "n": {"test": 4}})
    )
    questions = {"Q1": (1, "tiny", 4), "Q2": (1, "tiny", 0), "Q3": (2, "small", 1)}  # question -> steps, range, right
    with open(evaluated / "samples.jsonl", "w") as f:
        for q, (_, _, right) in questions.items():
            responses = [{"correct": i < right, "truncated": i == 3} for i in range(4)]
            f.write(json.dumps({"benchmark": "test", "question": q, "responses": responses}) + "\n")
    problems = tmp_path / "wp"
    problems.mkdir()
    (problems / "problems.jsonl").write_text(
        "".join(json.dumps({"question": q, "steps": s, "range": r}) + "\n" for q, (s, r, _) in questions.items())
    )
    monkeypatch.setattr(readme, "WORD_PROBLEMS", problems)
    run = tmp_path / "run"
    run.mkdir()
    shipped = (readme.ROOT / "configs" / "real_smollm2.yaml").read_text()
    (run / "config.yaml").write_text(re.sub(r"\n  lr: [^\n]*", "\n  lr: 4.0e-5", shipped))
    (run / "starts.jsonl").write_text(json.dumps({"time": "2026-12-07T10:00:00+00:00", "step": 0}) + "\n")
    (run / "summary.json").write_text(
        json.dumps(
            {"steps": 2, "heldout_accuracy_before": 0.25, "heldout_accuracy_after": 0.5, "heldout_temperature": 0.0}
        )
    )
    steps = [
        {"step": i, "loss": 0.1, "timing": {"rollout": 10.0 * i, "update": 4.0, "step": 10.0 * i + 4}} for i in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    # 20 unlabeled questions, TCS 0..19, the vote right on the odd ones and on question 19; the top 2 selected
    right = [i % 2 == 1 for i in range(20)]
    row = {"epoch": 2, "tcs": list(range(20)), "pseudo_correct": right, "selected": [i >= 18 for i in range(20)]}
    (run / "selection.jsonl").write_text(json.dumps(row) + "\n")
    page = tmp_path / "real-model.md"
    page.write_text(
        "".join(f"<!-- generated:{b} -->\n<!-- /generated:{b} -->\n" for b in ("real-passrates", "train-real"))
    )
    earlier = tmp_path / "earlier"  # a run as shipped, started first: its block comes first
    shutil.copytree(run, earlier)
    (earlier / "config.yaml").write_text(shipped)
    (earlier / "starts.jsonl").write_text(json.dumps({"time": "2026-12-07T09:00:00+00:00", "step": 0}) + "\n")
    argv = ["--real-base", str(evaluated), "--real-run", str(run), str(earlier), "--file", str(page)]
    assert readme.main(argv) == 0
    text = page.read_text()
    assert text.index("configs/real_smollm2.yaml as shipped:") < text.index("configs/real_smollm2.yaml with train.lr")
    # all: 3 questions, mean (1 + 0 + 0.25) / 3, one all wrong, one all right, 3 of 12 truncated; right 0..4: 1 0 1 0 1
    assert "| **test** | 3 | 0.417 | 0.33 | 0.33 | 0.25 | 1 | 0 | 0 | 0 | 1 |" not in text  # Q3 has 1 right
    assert "| **test** | 3 | 0.417 | 0.33 | 0.33 | 0.25 | 1 | 1 | 0 | 0 | 1 |" in text
    assert "| test: 1 step, tiny | 2 | 0.500 | 0.50 | 0.50 | 0.25 | 1 | 0 | 0 | 0 | 1 |" in text
    assert "| test: 2 steps, small | 1 | 0.250 | 0.00 | 0.00 | 0.25 | 0 | 1 | 0 | 0 | 0 |" in text
    assert "SmolLM2, 4 samples per question at temperature 0.7, at most 48 tokens" in text
    assert (tmp_path / "real-model" / "base-passrates.png").stat().st_size > 0
    assert passrates.read(evaluated / "samples.jsonl")[0]["steps"] is None  # without problems.jsonl: no cells
    assert "held-out accuracy (greedy): 0.250 before -> 0.500 after" in text
    assert "configs/real_smollm2.yaml with train.lr=4e-05:" in text
    # top 10% (TCS 18, 19): right on 19 only; bottom (0, 1): on 1 only; selected 18, 19; rejected 0..17: 9 of 18
    line = "majority vote right, over 1 epoch ends: top 10% by TCS 0.50 of 2, bottom 10% 0.50 of 2; selected 0.50"
    assert line + " of 2, rejected 0.50 of 18" in text
    assert "2 steps in 0.6 min of training; per step: rollout 15.0 s, grading 0.0 s, update 4.0 s" in text
