"""Step grading: gold rewards, majority-vote pseudo pass rates, hidden-gold precision."""

import math

from trapo.data import Question
from trapo.grading import grade


def q(answer, labeled):
    return Question("f:1", "x", answer, labeled, None, "f row 1")


def test_grade_labeled_and_unlabeled():
    questions = [q("12", True), q("7", False), q("5", False), q(None, False)]
    texts = [
        ["\\boxed{12}", "\\boxed{13}", "no box", "\\boxed{12.0}"],
        ["\\boxed{7}", "\\boxed{7}", "\\boxed{8}", "x"],  # majority 7 == hidden gold
        ["\\boxed{6}", "\\boxed{6}", "\\boxed{6}", "\\boxed{5}"],  # majority 6 != gold 5
        ["\\boxed{1}", "\\boxed{2}", "", ""],  # tie: no pseudo-label
    ]
    g = grade(questions, texts, timeout=5.0)
    assert g.rewards[0] == [1.0, 0.0, 0.0, 1.0] and g.pass_rates[0] == 0.5
    assert g.rewards[1] == [1.0, 1.0, 0.0, 0.0] and g.pass_rates[1] == 0.5
    assert g.rewards[2] == [1.0, 1.0, 1.0, 0.0] and g.pass_rates[2] == 0.75
    assert g.rewards[3] == [0.0] * 4 and g.pass_rates[3] == 0.0
    assert math.isnan(g.pseudo_correct[0]) and g.pseudo_correct[1:3] == [1.0, 0.0] and math.isnan(g.pseudo_correct[3])
