"""trapo.commands.prepare: source layouts, cleaning counts, decontamination, splits, determinism, errors,
trainer reads it."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from trapo.commands.prepare import PAPER_FILES, main, parser, prepare
from trapo.commands.prepare.cleaning import NGRAM, Contamination
from trapo.data import THINK_SYSTEM, DataError, load_questions, render_prompt, template_messages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A MATH-500 question of data/benchmarks/math.parquet (row 0), planted in the training sources.
MATH500_Q = (
    "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in the form "
    "$(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$"
)


def _math_rows(n: int, offset: int = 0) -> list[tuple[str, str]]:
    return [(f"Compute {i} plus {i + 1} and simplify the result.", str(2 * i + 1)) for i in range(offset, offset + n)]


def write_verl(path, rows, data_source="openr1"):
    """LUFFY's layout: system prompt + bare question, reward_model, the R1 `target`."""
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": data_source,
                    "prompt": [{"role": "system", "content": THINK_SYSTEM}, {"role": "user", "content": q}],
                    "target": [{"role": "assistant", "content": "long solution"}],
                    "ability": "math",
                    "reward_model": {"ground_truth": a, "style": "rule"},
                    "extra_info": {"index": i, "split": "default"},
                }
                for i, (q, a) in enumerate(rows)
            ]
        ),
        path,
    )
    return str(path)


def run(argv, capsys=None):
    args = parser().parse_args(argv)
    args.argv = argv
    return prepare(args, log=lambda m: None)


@pytest.fixture
def sources(tmp_path):
    """One small file per layout, with planted defects (counted by the cleaning)."""
    rows = _math_rows(40)
    rows += [
        ("An empty gold answer here.", ""),
        ("A gold Math-Verify cannot parse.", "\\frac{"),
        (rows[3][0].upper().replace(" ", "   "), rows[3][1]),  # duplicate after case/space normalisation
        (MATH500_Q.lower(), "(3, pi/2)"),  # an evaluation question, exactly
        ("Warm-up first. " + MATH500_Q + " Then also give r squared.", "9"),  # shares a 13-word run
    ]
    d = tmp_path / "src"
    d.mkdir()
    files = {"verl": write_verl(d / "luffy.parquet", rows)}
    pq.write_table(
        pa.table({"problem": [q for q, _ in rows[:10]], "answer": [a for _, a in rows[:10]], "solution": ["s"] * 10}),
        d / "openr1.parquet",
    )
    files["openr1"] = str(d / "openr1.parquet")
    pq.write_table(
        pa.table(
            {"question": [q for q, _ in rows[:10]], "final_answer": [a for _, a in rows[:10]], "difficulty": [5.0] * 10}
        ),
        d / "deepmath.parquet",
    )
    files["deepmath"] = str(d / "deepmath.parquet")
    mmlu = [
        {
            "question": f"Which option names law {i} of thermodynamics?",
            "options": ["first", "second", "third"],
            "answer": "ABC"[i % 3],
            "answer_index": i % 3,
            "category": "physics",
        }
        for i in range(12)
    ]
    mmlu.append(dict(mmlu[0], question=rows[0][0], options=[]))  # a labeled math question again
    pq.write_table(pa.Table.from_pylist(mmlu), d / "mmlu.parquet")
    files["mmlu_pro"] = str(d / "mmlu.parquet")
    with open(d / "qa.jsonl", "w") as f:
        for q, a in rows[:10]:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    files["qa"] = str(d / "qa.jsonl")
    return files


def test_luffy_layout_cleaning_counts_and_the_trainer_reads_it(sources, tmp_path):
    out = tmp_path / "train.parquet"
    manifest = run([sources["verl"], "--labeled", "10", "--unlabeled", "20", "--out", str(out)])
    assert manifest["counts"] == {
        "read": 45,
        "gold_unusable": 2,
        "duplicate": 1,
        "contaminated_exact": 1,
        "contaminated_ngram": 1,
        "kept": 40,
        "labeled": 10,
        "unlabeled": 20,
    }
    assert manifest["sources"][0]["layout"] == "verl" and len(manifest["sources"][0]["sha256"]) == 64
    assert [e["path"].rsplit("/", 1)[1] for e in manifest["exclude"]] == sorted(
        f for f in os.listdir(os.path.join(ROOT, "data", "benchmarks")) if f.endswith(".parquet")
    )
    on_disk = json.loads((tmp_path / "train.parquet.manifest.json").read_text())
    assert on_disk == manifest
    qs = load_questions([str(out)])
    assert sum(q.labeled for q in qs) == 10 and sum(not q.labeled for q in qs) == 20
    assert all(q.answer for q in qs)  # unlabeled rows keep their gold, for diagnostics only
    # The stored prompt is the think template's messages; the trainer renders the bare question the same way.
    table = pq.read_table(out).to_pylist()
    assert [r["extra_info"]["index"] for r in table] == list(range(30))
    for row, q in zip(table, qs):
        assert [(m["role"], m["content"]) for m in row["prompt"]] == template_messages(q.question, "think")
        assert q.question.startswith("Compute ") and row["data_source"] == "openr1"
        assert render_prompt(q, "think", None).count("This is the problem:") == 1


@pytest.mark.parametrize("layout", ["openr1", "deepmath", "qa", "mmlu_pro"])
def test_every_source_layout_is_detected_and_read(sources, tmp_path, layout):
    out = tmp_path / f"{layout}.parquet"
    manifest = run([sources[layout], "--labeled", "3", "--unlabeled", "all", "--out", str(out), "--template", "cot"])
    assert manifest["sources"][0]["layout"] == layout
    rows = pq.read_table(out).to_pylist()
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["prompt"][0]["content"].endswith("\\boxed{}.")
    if layout == "mmlu_pro":  # options listed as in the shipped ARC-c / GPQA files; the gold is the letter
        assert "\n\nA) first\nB) second\nC) third" in rows[0]["extra_info"]["question"]
        assert {r["reward_model"]["ground_truth"] for r in rows} == {"A", "B", "C"}
        assert rows[0]["ability"] == "general" and manifest["counts"]["kept"] == 13
    else:
        assert manifest["counts"]["kept"] == 10 and rows[0]["data_source"] == {"qa": "qa"}.get(layout, layout)
    assert len(load_questions([str(out)])) == manifest["counts"]["labeled"] + manifest["counts"]["unlabeled"]


def test_same_seed_same_bytes_another_seed_another_draw(sources, tmp_path):
    def draw(seed, name):
        out = tmp_path / name
        run([sources["verl"], "--labeled", "5", "--unlabeled", "5", "--seed", str(seed), "--out", str(out)])
        return out.read_bytes(), [q.question for q in load_questions([str(out)]) if q.labeled]

    a, b, c = draw(0, "a.parquet"), draw(0, "b.parquet"), draw(1, "c.parquet")
    assert a == b
    assert set(a[1]) != set(c[1])


def test_slices_take_contiguous_rows_labeled_first(sources, tmp_path):
    out = tmp_path / "s.parquet"
    run([sources["verl"], "--labeled", "4", "--unlabeled", "6", "--split", "slices", "--out", str(out)])
    qs = load_questions([str(out)])
    expect = [q for q, _ in _math_rows(40)]
    assert [q.question for q in qs if q.labeled] == expect[:4]
    assert [q.question for q in qs if not q.labeled] == expect[4:10]


def test_unlabeled_from_takes_the_ood_pool_without_a_labeled_question(sources, tmp_path):
    out = tmp_path / "ood.parquet"
    m = run(
        [
            sources["verl"],
            "--labeled",
            "8",
            "--unlabeled",
            "12",
            "--split",
            "slices",
            "--unlabeled-from",
            sources["mmlu_pro"],
            "--out",
            str(out),
        ]
    )
    qs = load_questions([str(out)])
    assert [q.question for q in qs if q.labeled] == [q for q, _ in _math_rows(8)]
    unlabeled = [q for q in qs if not q.labeled]
    assert len(unlabeled) == 12 and all(q.question.startswith("Which option") for q in unlabeled)
    assert m["counts"]["read_unlabeled_from"] == 13 and m["counts"]["duplicate_unlabeled_from"] == 1
    assert m["unlabeled_from"][0]["layout"] == "mmlu_pro"


def test_tokenizer_drops_long_prompts(sources, tmp_path, toy_dir):
    long_q = "Compute the value of " + " plus ".join(str(i) for i in range(60)) + "."
    src = write_verl(tmp_path / "long.parquet", _math_rows(6) + [(long_q, "1770")])
    out = tmp_path / "t.parquet"
    m = run(
        [
            src,
            "--labeled",
            "2",
            "--unlabeled",
            "all",
            "--out",
            str(out),
            "--template",
            "chat",
            "--tokenizer",
            os.path.join(toy_dir, "seed-0", "model"),
            "--max-prompt-tokens",
            "60",
        ]
    )
    assert m["counts"]["prompt_too_long"] == 1 and m["counts"]["kept"] == 6


def test_contamination_exact_and_ngram():
    bench = ["one two three four five six seven eight nine ten eleven twelve thirteen fourteen", "Short one."]
    c = Contamination(bench)
    assert c.check("SHORT   one") == "contaminated_exact"
    assert c.check("Prefix: two three four five six seven eight nine ten eleven twelve thirteen fourteen") == (
        "contaminated_ngram"
    )
    twelve = " ".join(bench[0].split()[: NGRAM - 1])
    assert c.check("zero " + twelve) is None  # 12 shared words are not enough


def test_errors_name_the_cause(sources, tmp_path):
    out = str(tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"asked for 30 labeled \+ 20 unlabeled rows, but 40 rows remain of 45 read"):
        run([sources["verl"], "--labeled", "30", "--unlabeled", "20", "--out", out])
    assert not os.path.exists(out)  # nothing written
    with pytest.raises(DataError, match="must end in .parquet"):
        run([sources["verl"], "--labeled", "1", "--out", str(tmp_path / "x.jsonl")])
    with pytest.raises(DataError, match="source not found"):
        run([str(tmp_path / "nope.parquet"), "--labeled", "1", "--out", out])
    with pytest.raises(DataError, match="--tokenizer needs --max-prompt-tokens"):
        run([sources["verl"], "--labeled", "1", "--out", out, "--tokenizer", str(tmp_path)])
    with pytest.raises(DataError, match="expected a row count or 'all'"):
        run([sources["verl"], "--labeled", "1k", "--out", out])


def test_unknown_layout_is_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a"], "label": ["b"]}), bad)
    res = subprocess.run(
        [sys.executable, "-m", "trapo", "prepare", str(bad), "--labeled", "1", "--out", str(tmp_path / "o.parquet")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "columns text, label match no known layout" in res.stderr and "openr1: problem, answer" in res.stderr


def test_paper_mode_writes_every_file_the_paper_configs_name(tmp_path):
    """`make data`: the sources folder laid out as the README says, every config's training file written."""
    names = set()
    for f in os.listdir(os.path.join(ROOT, "configs")):
        if f.endswith(".yaml") and not f.startswith(("toy", "real")):  # real_*: written by trapo word-problems
            with open(os.path.join(ROOT, "configs", f)) as fh:
                names.update(os.path.basename(p) for p in yaml.safe_load(fh)["data"]["train_files"])
    assert names == set(PAPER_FILES)
    src = tmp_path / "sources"
    (src / "openr1-46k" / "data").mkdir(parents=True)
    (src / "deepmath-103k").mkdir()
    (src / "mmlu-pro").mkdir()
    # Few distinct golds keep Math-Verify's parse to a handful; questions are distinct.
    n = 16400
    pq.write_table(
        pa.table(
            {"problem": [f"Find item {i} of the list." for i in range(n)], "answer": [str(i % 7) for i in range(n)]}
        ),
        src / "openr1-46k" / "data" / "train.parquet",
    )
    pq.write_table(
        pa.table({"question": [f"Evaluate entry {i}." for i in range(10000)], "final_answer": ["2"] * 10000}),
        src / "deepmath-103k" / "train.parquet",
    )
    write_verl(
        src / "mmlu-pro" / "valid.mmlu_pro.parquet", [(f"Pick option {i}.", "B") for i in range(1100)], "mmlu_pro"
    )
    assert main(["--paper", str(src), "--out-dir", str(tmp_path / "data"), "--workers", "1"]) == 0
    for name in names:
        qs = load_questions([str(tmp_path / "data" / name)])
        m = json.loads((tmp_path / "data" / f"{name}.manifest.json").read_text())
        assert m["counts"]["labeled"] == sum(q.labeled for q in qs)
    ood = load_questions([str(tmp_path / "data" / "math_1k_labeled_ood_1k_unlabeled.parquet")])
    assert [q.question for q in ood if not q.labeled][:2] == ["Pick option 0.", "Pick option 1."]
    assert len(load_questions([str(tmp_path / "data" / "openr1_45k.parquet")])) == n


def test_a_hub_dataset_id_is_a_source_and_the_manifest_records_its_commit(sources, tmp_path, hub_cache):
    data = tmp_path / "hub-files"
    (data / "data").mkdir(parents=True)
    write_verl(data / "data" / "train-00000.parquet", _math_rows(30))
    hub_cache.add("someorg/openr1-46k", data, "c" * 40, repo_type="dataset")
    out = tmp_path / "hub.parquet"
    manifest = run(["someorg/openr1-46k", "--labeled", "10", "--unlabeled", "10", "--out", str(out)])
    assert manifest["sources"][0]["hub"] == f"someorg/openr1-46k@{'c' * 40}" and manifest["counts"]["read"] == 30
    local = run([str(data), "--labeled", "10", "--unlabeled", "10", "--out", str(tmp_path / "local.parquet")])
    same = ["prompt", "reward_model", "data_source"]  # the same rows, wherever they were read from
    assert pq.read_table(out, columns=same) == pq.read_table(tmp_path / "local.parquet", columns=same)
    assert "hub" not in local["sources"][0]
    with pytest.raises(Exception, match="SOURCE nosuch/data: not a local directory, and not in the hub cache"):
        run(["nosuch/data", "--labeled", "1", "--out", str(out)])
    assert main(["nosuch/data", "--labeled", "1", "--out", str(out)]) == 2  # one line, no traceback


def test_one_progress_bar_per_source_file_only_on_a_terminal(sources, tmp_path, monkeypatch, tty):
    from trapo import console

    a, b = write_verl(tmp_path / "a.parquet", _math_rows(20)), write_verl(tmp_path / "b.parquet", _math_rows(20, 20))
    run([a, b, "--labeled", "10", "--unlabeled", "10", "--out", str(tmp_path / "x.parquet")])
    assert "a.parquet: rows" in tty.text and "b.parquet: rows" in tty.text and "20/20" in tty.text
    tty.text = ""
    run([a, b, "--labeled", "10", "--unlabeled", "10", "--out", str(tmp_path / "y.parquet"), "--no-progress"])
    assert tty.text == ""  # asked
    monkeypatch.setattr(console, "_terminal", None)  # stderr under pytest: no tty
    assert console.progress_bar(10, "x").disable


def test_malformed_and_invalid_rows_are_named_by_file_and_line_and_prose_golds_are_dropped(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": \n')
    out = str(tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not valid JSON \(Expecting value, column \d+\)"):
        run([str(bad_json), "--labeled", "1", "--out", out])
    assert main([str(bad_json), "--labeled", "1", "--out", out]) == 2  # one line, no traceback
    # A bad row on the file's 8th line (a blank line before it) is named by that 1-based line, as training
    # names it; the first row's being fine is no longer hidden behind "cannot read the first JSONL row".
    good = "".join(json.dumps({"question": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(6))
    surrogate = tmp_path / "sur.jsonl"
    surrogate.write_text(good + '\n{"question": "a \\ud800", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"sur.jsonl line 8: field 'question' holds invalid Unicode"):
        run([str(surrogate), "--labeled", "1", "--out", out])
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes(good.encode() + b"\n" + '{"question": "caf\u00e9?", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl line 8: not UTF-8 text \(byte 0xe9 at column 18\)"):
        run([str(not_utf8), "--labeled", "1", "--out", out])
    assert main([str(not_utf8), "--labeled", "1", "--out", out]) == 2  # one line, no traceback
    first_bad = tmp_path / "first.jsonl"
    first_bad.write_bytes(b"\n\xff\n" + good.encode())
    with pytest.raises(DataError, match=r"first.jsonl line 2: not UTF-8 text \(byte 0xff at column 1\)"):
        run([str(first_bad), "--labeled", "1", "--out", out])
    raw = pa.array([b"1+1?", b"caf\xe9?"], type=pa.binary())  # a string column's bytes, not UTF-8 in row 1
    latin1 = tmp_path / "latin1.parquet"
    question = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    pq.write_table(pa.table({"question": question, "final_answer": pa.array(["2", "3"])}), latin1)
    with pytest.raises(DataError, match=r"latin1.parquet row 1: field 'question' is not UTF-8 text \(byte 0xe9"):
        run([str(latin1), "--labeled", "1", "--out", out])
    rows = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]
    rows += [{"question": "Which one?", "answer": "see the solution above"}]
    prose = tmp_path / "prose.jsonl"
    prose.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = run([str(prose), "--labeled", "all", "--out", out])
    assert manifest["counts"]["gold_unusable"] == 1 and manifest["counts"]["labeled"] == 6


def test_a_prompt_file_is_stored_around_each_question_and_read_as_the_dataset_template(sources, tmp_path):
    prompt = tmp_path / "prompt.json"
    messages = [
        {"role": "system", "content": "Box the answer."},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "\\boxed{2}"},
        {"role": "user", "content": "Now: {question}"},
    ]
    prompt.write_text(json.dumps(messages))
    out = tmp_path / "train.parquet"
    manifest = run([sources["qa"], "--labeled", "3", "--unlabeled", "all", "--out", str(out), "--prompt", str(prompt)])
    assert manifest["options"]["prompt"]["sha256"] == hashlib.sha256(prompt.read_bytes()).hexdigest()
    assert manifest["options"]["template"] is None
    qs = load_questions([str(out)])
    for row, q in zip(pq.read_table(out).to_pylist(), qs):
        assert row["prompt"][:3] == messages[:3] and row["prompt"][3]["content"] == f"Now: {q.question}"
        assert q.messages[-1] == ("user", f"Now: {q.question}")  # the trainer's `dataset` template renders these
        assert render_prompt(q, "dataset", None).startswith("System: Box the answer.\nUser: 1 + 1?\n")


@pytest.mark.parametrize(
    "content, error",
    [
        ("not json", "cannot read it as JSON"),
        (json.dumps({"role": "user"}), "expected a JSON list"),
        (json.dumps([{"role": "robot", "content": "{question}"}]), "message 0 is not"),
        (json.dumps([{"role": "user", "content": "no placeholder"}]), "holding {question} exactly once"),
        (
            json.dumps([{"role": "system", "content": "{question}"}, {"role": "user", "content": "{question}"}]),
            "only the last",
        ),
    ],
)
def test_a_bad_prompt_file_is_named_with_the_fix(sources, tmp_path, content, error):
    prompt = tmp_path / "p.json"
    prompt.write_text(content)
    out = tmp_path / "train.parquet"
    with pytest.raises(DataError, match=re.escape(f"--prompt {prompt}: ") + ".*" + re.escape(error)):
        run([sources["qa"], "--labeled", "3", "--unlabeled", "all", "--out", str(out), "--prompt", str(prompt)])
    assert not out.exists()
