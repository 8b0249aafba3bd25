"""A task verifier (`reward.verifier=module:name`) written outside the repository, on the toy: two ranks, its
extractions and verdicts in the rollout dumps, pseudo-labels by its keys, and an exact resume."""

import json
import os
import sys
import textwrap

import pytest
from toyrun import metrics, overrides, train

from trapo import runtime

pytestmark = pytest.mark.toy_run

# Reads the last box; leading zeros and spaces do not matter, by its key and by its equal alike.
MODULE = textwrap.dedent(
    """
    import re

    class Digits:
        def extract(self, response):
            found = re.findall(r"\\\\boxed\\{([^{}]*)\\}", response)
            return found[-1] if found else None

        def equal(self, answer, gold):
            return self.key(answer) == self.key(gold)

        def key(self, answer):
            return answer.strip().lstrip("0") or "0"
    """
)


def test_a_custom_verifier_on_two_ranks_grades_the_dumps_votes_by_key_and_resumes_exactly(toy_dir, tmp_path):
    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "digits_verifier.py").write_text(MODULE)
    env = runtime.subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ext), env.get("PYTHONPATH", "")) if p)
    common = {
        "mode": "trapo",
        "max_steps": 5,
        "save_steps": 4,
        "logging.rollouts_every": 1,
        "reward.verifier": "digits_verifier:Digits",
    }
    train(overrides(toy_dir, tmp_path, run_name="task", **common), nproc=2, env=env)
    m = metrics(tmp_path / "task")
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5] and "selection" in m[3]  # an epoch end: TCS selected

    sys.path.insert(0, str(ext))
    try:
        from digits_verifier import Digits
    finally:
        sys.path.remove(str(ext))
    v = Digits()
    labeled = voted = 0
    for step in range(1, 6):
        for row in map(json.loads, (tmp_path / "task" / "rollouts" / f"step-{step}.jsonl").open()):
            answers = [v.extract(r) for r in row["responses"]]
            assert row["answers"] == answers  # the dump's answers are the verifier's extractions
            if row["labeled"]:
                verdicts = [1.0 if a is not None and v.equal(a, row["gold"]) else 0.0 for a in answers]
                assert row["rewards"] == verdicts
                labeled += 1
            elif row["pseudo_label"] is not None:
                counts = {}
                for a in answers:
                    if a is not None:
                        counts[v.key(a)] = counts.get(v.key(a), 0) + 1
                assert counts[v.key(row["pseudo_label"])] == max(counts.values())  # a most common answer by key
                assert row["rewards"] == [
                    float(a is not None and v.key(a) == v.key(row["pseudo_label"])) for a in answers
                ]
                voted += 1
    assert labeled and voted

    resumed = overrides(
        toy_dir, tmp_path, run_name="re", resume_from=tmp_path / "task" / "checkpoints" / "step-4", **common
    )
    train(resumed, nproc=2, env=env)
    (again,) = metrics(tmp_path / "re")
    for key in ("loss", "pg_loss", "reward_labeled", "pass_rate_unlabeled", "pass_rate_labeled", "response_tokens"):
        assert again.get(key) == m[4].get(key), key
