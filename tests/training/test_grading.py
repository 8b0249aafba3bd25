"""Step grading: gold rewards, majority-vote pseudo pass rates, hidden-gold precision; and end to end, a run whose
first Math-Verify supervisor dies while it starts (the grader_first_start fault, trapo/faults.py)."""

import math
import time

import pytest
from toyrun import metrics, overrides, train

from trapo import faults, runtime
from trapo.algorithm.rewards.unlabeled import UnlabeledReward
from trapo.data import Question
from trapo.engine.grading.verifier import MathVerifier
from trapo.training.grading import grade


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


def test_cluster_share_rewards_each_answer_with_its_clusters_share_of_the_group():
    """EMPO's reward (arXiv 2504.05812): p(c | q), the share of the G answers in an answer's cluster of
    equivalent answers; no answer: 0. By hand: clusters {1/2: 3, 3: 2} of 6 answers, one without an answer."""
    texts = [["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", "\\boxed{3}", "\\boxed{3}", "no box"]]
    g = grade([q("1/2", False)], texts, timeout=5.0, unlabeled=UnlabeledReward("cluster_share"))
    assert g.rewards == [[0.5, 0.5, 0.5, 2 / 6, 2 / 6, 0.0]]
    assert g.pass_rates == [0.5] and g.pseudo_labels == ["0.5"] and g.pseudo_correct == [1.0]  # the vote's, as before
    tie = grade(
        [q(None, False)], [["\\boxed{1}", "\\boxed{2}"]], timeout=5.0, unlabeled=UnlabeledReward("cluster_share")
    )
    assert tie.rewards == [[0.5, 0.5]] and tie.pass_rates == [0.0]  # no pseudo-label, but each cluster has its share
    labeled = grade(
        [q("12", True)], [["\\boxed{12}", "\\boxed{13}"]], timeout=5.0, unlabeled=UnlabeledReward("cluster_share")
    )
    assert labeled.rewards == [[1.0, 0.0]]  # a labeled question keeps its gold reward


TOWERS = [f"9^{{9^{{9^{{{k}}}}}}}" for k in range(4, 12)]  # evaluating these runs into any timeout


def test_grade_counts_nothing_on_ordinary_answers():
    g = grade([q("12", True), q("7", False)], [["\\boxed{12}", "\\boxed{x+1}"], ["\\boxed{7}"] * 2], timeout=5.0)
    assert g.rewards == [[1.0, 0.0], [1.0, 1.0]] and g.pseudo_correct[1] == 1.0
    assert (g.timeouts, g.budget_cut) == (0, 0)


def test_grade_on_degenerate_outputs_counts_timeouts_and_stays_bounded():
    verifier = MathVerifier(num_workers=2, timeout=1.0)
    verifier.start()
    try:
        texts = [[f"\\boxed{{{t}}}" for t in TOWERS]] * 2 + [["\\boxed{x+1}"] * 6 + ["\\boxed{1+x}", "\\boxed{y}"]]
        questions = [q("\\frac{1}{2}", True), q("5", False), q("x+1", False)]
        start = time.monotonic()
        g = grade(questions, texts, timeout=1.0, verifier=verifier)
        # labeled rewards and the vote's parsing, each about one timeout: not one per comparison (8 + 28 of 1 s
        # on 2 workers: 18 s); the timeout counts below are the outcome, a slow loaded machine gets slack here
        assert time.monotonic() - start < 12
        assert g.rewards[0] == [0.0] * 8 and g.rewards[1] == [0.0] * 8 and g.pass_rates[2] == 7 / 8
        assert g.pseudo_correct[1:] == [0.0, 1.0]  # 8 singletons: a tie, no pseudo-label
        assert g.timeouts == 8 + 8 and g.budget_cut == 0

        start = time.monotonic()  # with a budget, whatever is not decided in time counts as not equal
        g = grade(questions[:2], [[f"\\boxed{{{t}}}" for t in TOWERS[::-1]]] * 2, 30.0, verifier, budget=0.5)
        assert time.monotonic() - start < 10  # cut at the budget, not after the 30 s timeout
        assert g.rewards == [[0.0] * 8] * 2 and g.budget_cut == 8 + 28 and g.timeouts == 0
    finally:
        verifier.close()


def test_a_spent_budget_sends_nothing_to_the_workers():
    verifier = MathVerifier(num_workers=1)
    questions = [q("12", True), q("x+1", False)]
    texts = [["\\boxed{12.0}", "\\boxed{13}", "\\boxed{2\\cdot 6}"], ["\\boxed{1+x}", "\\boxed{x+1}", "\\boxed{y}"]]
    g = grade(questions, texts, timeout=5.0, verifier=verifier, budget=0.0)
    assert verifier._supervisor is None  # never even started
    assert g.rewards[0] == [1.0, 0.0, 0.0]  # exact fast paths still decide; `2\cdot 6` needed Math-Verify: cut
    assert g.rewards[1] == [0.0, 0.0, 0.0]  # three singletons (x+1 vs 1+x was cut): a tie
    assert g.budget_cut == 1 + 3 and g.timeouts == 0


@pytest.mark.toy_run
def test_a_run_whose_first_grader_dies_while_starting_ends_as_an_undisturbed_one(toy_dir, tmp_path):
    """The first supervisor kills itself during its start-up, as the out-of-memory killer would: it is retried as a
    replacement is, and the run's metrics are an undisturbed run's (timings aside)."""
    clean = train(overrides(toy_dir, tmp_path, run_name="clean", max_steps=3, mode="trapo"))
    env = runtime.subprocess_env(**faults.env("grader_first_start"))
    killed = train(overrides(toy_dir, tmp_path, run_name="killed", max_steps=3, mode="trapo"), env=env)
    assert "Traceback" not in clean.stderr + killed.stderr
    with open(tmp_path / "killed" / "log.txt") as f:
        assert "Math-Verify: a supervisor failed to start" in f.read()  # the fault did kill the first start
    untimed = ("timing", "tokens_per_s", "rollout_generate_s")
    rows = [
        [{k: v for k, v in r.items() if k not in untimed} for r in metrics(tmp_path / n)] for n in ("clean", "killed")
    ]
    assert [r["step"] for r in rows[0]] == [1, 2, 3] and rows[1] == rows[0]
