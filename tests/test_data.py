"""Training data: both layouts, validation errors naming file/row/field, splits, prompts, batch order."""

import json
import os

import pytest

from trapo.data import (
    THINK_SYSTEM,
    DataError,
    epoch_batches,
    gold_problem,
    gradable,
    load_questions,
    render_prompt,
    select_for_mode,
    tokenize_prompts,
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_reads_verl_parquet(benchmarks_dir):
    qs = load_questions([os.path.join(benchmarks_dir, "gpqa.parquet"), os.path.join(benchmarks_dir, "arc_c.parquet")])
    assert len(qs) == 198 + 1172 and all(q.labeled for q in qs)
    assert qs[0].question.startswith("Two quantum states with energies E1 and E2")
    assert qs[0].answer in "ABCD" and qs[0].messages[0][0] == "system"


def test_repeated_benchmark_rows_are_duplicate_training_ids(benchmarks_dir):
    # math.parquet repeats each AIME question 8 times under one index: fine for
    # evaluation, a duplicate for training, and reported as such.
    with pytest.raises(DataError, match=r"math.parquet row 1448: duplicate id 'aime/1447' \(first at .*row 1447\)"):
        load_questions([os.path.join(benchmarks_dir, "math.parquet")])


def test_jsonl_flags_and_hidden_golds(tmp_path):
    f = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"question": "1+1=", "answer": "2", "labeled": True},
            {"question": "2+2=", "answer": "4", "labeled": False},  # hidden gold
            {"question": "3+3="},  # no answer: unlabeled
        ],
    )
    qs = load_questions([f])
    assert [q.labeled for q in qs] == [True, False, False]
    assert qs[1].answer == "4"
    unsup = select_for_mode(qs, "unsupervised")
    assert not any(q.labeled for q in unsup) and unsup[0].answer == "2"
    assert len(select_for_mode(qs, "supervised")) == 1


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([{"answer": "2"}], "line 1: field 'question' is missing"),
        ([{"question": "  ", "answer": "2"}], "line 1: field 'question' is empty"),
        ([{"question": "q", "labeled": True}], "line 1: a labeled row needs an answer"),
        ([{"question": ["q"], "answer": "1"}], "line 1: field 'question' must be a string, got list"),
        ([{"question": "q", "answer": "1", "labeled": "yes"}], "line 1: field 'labeled' must be true or false"),
        (
            [{"id": 7, "question": "a", "answer": "1"}, {"id": 7, "question": "b", "answer": "2"}],
            "line 2: duplicate id '7' (first at",
        ),
    ],
)
def test_bad_rows_are_named(tmp_path, rows, needle):
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_questions([f])
    assert "bad.jsonl" in str(err.value) and needle in str(err.value)


def test_invalid_unicode_is_named_by_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "ok", "answer": "1"}\n{"question": "a \\ud800 b", "answer": "2"}\n')  # JSON's escape
    with pytest.raises(DataError, match=r"bad.jsonl line 2: field 'question' holds invalid Unicode .*'\\ud800'"):
        load_questions([str(f)])


def test_bytes_that_are_not_utf8_are_named_by_file_line_and_column_in_one_line(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"question": "ok", "answer": "1"}\n\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError) as err:
        load_questions([str(f)])
    assert str(err.value) == (
        f"{f} line 3: not UTF-8 text (byte 0xe9 at column 18); re-encode the file as UTF-8 or remove the row"
    )


def test_parquet_text_that_is_not_utf8_is_named_by_file_row_and_field_in_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = pa.array([b"ok", b"caf\xe9"], type=pa.binary())  # bytes a string column holds as they are
    question = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    f = tmp_path / "latin1.parquet"
    pq.write_table(pa.table({"answer": pa.array(["1", "2"]), "question": question}), f)
    with pytest.raises(DataError) as err:
        load_questions([str(f)])
    assert str(err.value) == (
        f"{f} row 1: field 'question' is not UTF-8 text (byte 0xe9 at byte 4 of its text); "
        "re-encode the file's text as UTF-8 or remove the row"
    )


@pytest.mark.parametrize(
    "gold, problem",
    [
        ("see the solution above", "prose"),
        ("The answer is 5", "prose"),
        ("", "empty"),
        ("  ", "empty"),
        (None, "empty"),
        ("5", None),
        ("\\frac{1}{2}", None),
        ("red, green, blue", None),
        ("\\text{Monday}", None),
        ("x = 2", None),
        ("infinitely many", None),
        ("\\text{not a number}", None),
    ],
)
def test_gold_problem_by_hand(gold, problem):
    assert gold_problem(gold) == problem


def test_a_labeled_row_whose_gold_cannot_be_graded_is_an_error_or_dropped_when_asked(tmp_path):
    rows = [
        {"question": "1+1?", "answer": "2"},
        {"question": "2+2?", "answer": "see the solution above"},
        {"question": "3+3?", "answer": "", "labeled": True},
        {"question": "u?", "labeled": False},
    ]
    questions = load_questions([write_jsonl(tmp_path / "t.jsonl", rows)])
    with pytest.raises(DataError, match=r"t.jsonl line 2: a labeled row's gold is prose .*\(2 such rows in all\)"):
        gradable(questions, drop=False)
    kept, dropped = gradable(questions, drop=True)
    assert dropped == 2 and [q.question for q in kept] == ["1+1?", "u?"]


def test_modes_that_need_unlabeled_rows_refuse_files_without_any(tmp_path):
    questions = load_questions([write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1?", "answer": "2"}])])
    for mode in ("trapo", "naive_semi"):
        with pytest.raises(DataError, match=f"mode '{mode}' needs unlabeled questions"):
            select_for_mode(questions, mode)
    assert select_for_mode(questions, "supervised") == questions


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="training file not found"):
        load_questions([str(tmp_path / "nope.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format"):
        load_questions([str(tmp_path / "x.csv")])
    (tmp_path / "b.jsonl").write_text('{"question": "q"\n')
    with pytest.raises(DataError, match="b.jsonl line 1: not valid JSON"):
        load_questions([str(tmp_path / "b.jsonl")])


def test_ratio_split_is_seeded(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(100)])
    a = [q.labeled for q in load_questions([f], labeled_ratio=0.25, seed=1)]
    b = [q.labeled for q in load_questions([f], labeled_ratio=0.25, seed=1)]
    c = [q.labeled for q in load_questions([f], labeled_ratio=0.25, seed=2)]
    assert a == b and sum(a) == 25 and a != c


def test_prompt_templates(tmp_path):
    from trapo.commands.toy import _tokenizer

    tok = _tokenizer(["12+34=\\boxed{46}"])
    f = write_jsonl(tmp_path / "t.jsonl", [{"question": "12+34=", "answer": "46"}])
    (q,) = load_questions([f])
    assert render_prompt(q, "plain", tok) == "12+34="
    think = render_prompt(q, "think", tok)  # no chat template: plain role layout
    assert think.startswith("System: " + THINK_SYSTEM) and "User: This is the problem: 12+34=" in think
    assert think.endswith("Assistant:<think>\n")
    assert "Let's think step by step" in render_prompt(q, "cot", tok)
    with pytest.raises(DataError, match="over data.max_prompt_tokens=3"):
        tokenize_prompts([q], "plain", tok, 3)


def test_epoch_batches_cover_each_question_once_per_epoch():
    batches = epoch_batches(70, 16, 4, seed=0, epoch=0)
    flat = [i for b in batches for i in b]
    assert [len(b) for b in batches] == [16, 16, 16, 16, 4]  # last: 6 left, rounded down to 4 ranks
    assert len(set(flat)) == 68
    assert epoch_batches(70, 16, 4, 0, 0) == batches and epoch_batches(70, 16, 4, 0, 1) != batches


def test_epoch_batches_under_a_curriculum_keep_the_order_and_top_the_last_batch_up():
    """sampling.curriculum: the (seed, epoch) permutation without the skipped questions, except the first skipped
    ones in it, which fill the last batch; everyone admitted still comes once, and every batch is full."""
    full = [q for batch in epoch_batches(64, 16, 16, seed=3, epoch=2) for q in batch]
    assert epoch_batches(64, 16, 16, 3, 2, admitted=[True] * 64) == epoch_batches(64, 16, 16, 3, 2)
    skipped = set(range(0, 40, 2))  # 20 skipped: 44 admitted, 4 short of 3 full batches
    batches = epoch_batches(64, 16, 16, 3, 2, admitted=[q not in skipped for q in range(64)])
    flat = [q for batch in batches for q in batch]
    assert [len(b) for b in batches] == [16, 16, 16]
    fill = [q for q in full if q in skipped][:4]  # the first skipped ones in the permutation
    assert flat == [q for q in full if q not in skipped or q in fill]
    # 16 skipped: 48 admitted fill 3 batches exactly, nothing topped up
    exact = epoch_batches(64, 16, 16, 3, 2, admitted=[q >= 16 for q in range(64)])
    assert [q for b in exact for q in b] == [q for q in full if q >= 16]
