"""trapo.training.rollout_dump (logging.rollouts_every) and the answers / pseudo-labels that grading now carries."""

import json

import pytest

from trapo.algorithm.rewards import math_rewards
from trapo.data import Question
from trapo.engine.grading.verifier import default_verifier
from trapo.training.grading import Grades, grade
from trapo.training.rollout_dump import due, dump_step, latest_dump, question_rows, write_rows


def q(uid, answer, labeled):
    return Question(uid, "x", answer, labeled, None, f"{uid} row 1")


QUESTIONS = [q("a", "12", True), q("b", "7", False), q("c", None, False)]
TEXTS = [
    ["\\boxed{12}", "\\boxed{13}", "no box", "\\boxed{12.0}"],
    ["\\boxed{7}", "\\boxed{7}", "\\boxed{8}", "x"],  # majority 7 == hidden gold
    ["\\boxed{1}", "\\boxed{2}", "", ""],  # a tie: no pseudo-label
]


def test_grades_carry_each_answer_and_the_pseudo_label_without_changing_rewards():
    g = grade(QUESTIONS, TEXTS, timeout=5.0)
    assert g.answers == [["12", "13", None, "12.0"], ["7", "7", "8", None], ["1", "2", None, None]]
    assert g.pseudo_labels == [None, "7", None]
    # the labeled rewards equal the reference path, math_rewards on the whole texts
    assert g.rewards[0] == math_rewards(TEXTS[0], ["12"] * 4, default_verifier()) == [1.0, 0.0, 0.0, 1.0]
    assert g.rewards[1:] == [[1.0, 1.0, 0.0, 0.0], [0.0] * 4] and g.pseudo_correct[1] == 1.0


def test_rows_hold_what_was_generated_and_how_it_was_scored():
    g = grade(QUESTIONS, TEXTS, timeout=5.0)
    rewards = [g.rewards[0], [0.5, 0.25, 0.0, 1.0], g.rewards[2]]  # a confidence reward replaced question b's
    rows = question_rows([4, 9, 2], QUESTIONS, ["P4", "P9", "P2"], TEXTS, rewards, g, gate=[1.0, 0.0, 1.0])
    assert rows[0] == {
        "question": 4,
        "uid": "a",
        "labeled": True,
        "prompt": "P4",
        "responses": TEXTS[0],
        "rewards": [1.0, 0.0, 0.0, 1.0],
        "answers": ["12", "13", None, "12.0"],
        "pseudo_label": None,
        "gold": "12",
        "pseudo_correct": None,
        "in_loss": True,
    }
    assert (rows[1]["pseudo_label"], rows[1]["gold"], rows[1]["pseudo_correct"]) == ("7", None, True)
    assert rows[1]["rewards"] == [0.5, 0.25, 0.0, 1.0] and rows[1]["in_loss"] is False  # gated out (M = 0)
    assert (rows[2]["pseudo_label"], rows[2]["pseudo_correct"], rows[2]["in_loss"]) == (None, None, True)
    json.dumps(rows)  # plain JSON


def test_due_every_n_steps_from_step_one():
    assert [s for s in range(1, 11) if due(3, s)] == [3, 6, 9]
    assert [s for s in range(1, 4) if due(1, s)] == [1, 2, 3]
    assert not any(due(0, s) for s in range(1, 100))


def test_dump_step_writes_on_due_steps_only_and_overwrites_whole(tmp_path):
    g = grade(QUESTIONS, TEXTS, timeout=5.0)
    args = dict(
        prompts=[[1, 2], [3], [4]],
        decode=lambda ids: "-".join(map(str, ids)),
        texts=TEXTS,
        rewards=g.rewards,
        grades=g,
        gate=[1.0, 1.0, 0.0],
    )
    assert dump_step(2, tmp_path, 3, [0, 1, 2], QUESTIONS, **args) is None
    assert not (tmp_path / "rollouts").exists()
    path = dump_step(2, tmp_path, 4, [0, 1, 2], QUESTIONS, **args)
    assert path == tmp_path / "rollouts" / "step-4.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["1-2", "3", "4"] and [r["in_loss"] for r in rows] == [True, True, False]
    # a resumed run redoing step 4 replaces the file, never appends to it or leaves a temporary beside it
    one = grade(QUESTIONS[:1], TEXTS[:1], timeout=5.0)
    redo = dict(prompts=[[9]], texts=TEXTS[:1], rewards=one.rewards, grades=one, gate=[1.0])
    assert dump_step(2, tmp_path, 4, [0], QUESTIONS[:1], decode=args["decode"], **redo) == path
    assert [json.loads(line)["prompt"] for line in path.read_text().splitlines()] == ["9"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-4.jsonl"]


def test_a_dump_that_cannot_be_built_is_a_warning_not_a_crash(tmp_path, capsys):
    g = grade(QUESTIONS, TEXTS, timeout=5.0)
    bare = Grades(g.rewards, g.pass_rates, g.pseudo_correct)  # grades made without the answers
    args = dict(prompts=[[1], [2], [3]], decode=str, texts=TEXTS, rewards=g.rewards, gate=[1.0] * 3)
    assert dump_step(1, tmp_path, 7, [0, 1, 2], QUESTIONS, grades=bare, **args) is None
    captured = capsys.readouterr()
    assert "warning: rollout dump of step 7 not written (rank 0: ValueError: rows of different lengths" in (
        captured.out + captured.err
    )
    assert not (tmp_path / "rollouts").exists()


@pytest.mark.parametrize("small_disk", ["16k"], indirect=True)  # a real 16 KB filesystem (conftest)
def test_a_full_disk_is_a_warning_and_the_old_file_stays(small_disk, capsys):
    if small_disk is None:
        pytest.skip("mounting a tmpfs needs root")
    path = small_disk / "rollouts" / "step-1.jsonl"
    assert write_rows(path, [{"responses": ["short"]}])
    assert not write_rows(path, [{"responses": ["y" * 4096] * 8}])  # 32 KB into 16 KB: ENOSPC
    captured = capsys.readouterr()
    assert f"warning: rollout dump {path} not written (No space left on device)" in captured.out + captured.err
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"responses": ["short"]}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1.jsonl"]  # the partial file removed


def test_latest_dump_is_the_highest_step(tmp_path):
    assert latest_dump(tmp_path) is None
    for name in ("step-9.jsonl", "step-10.jsonl", "step-x.jsonl", ".step-11.jsonl.tmp"):
        (tmp_path / "rollouts").mkdir(exist_ok=True)
        (tmp_path / "rollouts" / name).write_text("")
    assert latest_dump(tmp_path) == tmp_path / "rollouts" / "step-10.jsonl"  # numeric, not by name
