"""The efficiency report (trapo/commands/reproduce/efficiency.py) on hand-written runs: tokens to reach the
baseline's best validation accuracy, the zero-advantage share, test accuracy at the best validation step, and
a seed that never reaches the target keeps a claim from being held."""

import dataclasses
import json
import os

import pytest
import yaml

from trapo.commands.reproduce import efficiency
from trapo.commands.reproduce.study import load_study
from trapo.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run(run_dir, tokens, zero, evals):
    """metrics.jsonl of a run: tokens and zero-advantage share per step, evals {step: (validation, test)}."""
    run_dir.mkdir(parents=True)
    rows = []
    for step, (t, z) in enumerate(zip(tokens, zero), start=1):
        row = {"step": step, "response_tokens": t, "zero_advantage_frac": z}
        if step in evals:
            v, test = evals[step]
            row["eval"] = {"validation": v, "test": test, "test_ood": 0.9}
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def study(steps=4):
    return dataclasses.replace(
        load_study(os.path.join(ROOT, "configs", "studies", "toy", "curriculum.yaml")), steps=steps, eval_every=2
    )


def test_tokens_to_reach_the_baselines_best_and_the_other_read_outs(tmp_path):
    dirs = {}
    for seed, shift in ((0, 0.0), (1, 0.01), (2, 0.02)):
        # the baseline peaks at step 4 (0.5 + shift); the curriculum reaches that at step 2 with fewer tokens
        dirs[("none", seed)] = write_run(
            tmp_path / f"none{seed}", [100] * 4, [0.5, 0.5, 0.5, 0.5], {2: (0.4, 0.3), 4: (0.5 + shift, 0.35)}
        )
        dirs[("trajectory", seed)] = write_run(
            tmp_path / f"traj{seed}",
            [100, 90 + seed, 100, 100],
            [0.5, 0.3, 0.3, 0.3],
            {2: (0.5 + shift, 0.4), 4: (0.45, 0.2)},
        )
    text = efficiency.write_report(study(), {k: efficiency.run_values(d) for k, d in dirs.items()}, tmp_path / "docs")
    res = json.loads((tmp_path / "docs" / "curriculum.json").read_text())
    claims = {c["name"]: c for c in res["claims"]}
    tokens = claims["fewer_tokens_to_baseline_best"]
    assert tokens["differences"] == [400 - 190, 400 - 191, 400 - 192] and tokens["verdict"] == "held"
    zero = claims["fewer_zero_advantage_groups"]
    assert [round(d, 9) for d in zero["differences"]] == [0.15] * 3 and zero["verdict"] == "held"
    test = claims["test_accuracy_at_best_validation"]  # the curriculum's best validation is step 2 (test 0.4)
    assert [round(d, 9) for d in test["differences"]] == [0.05] * 3
    none = res["conditions"]["none"]
    assert none["best_step"]["per_seed"] == [4, 4, 4] and none["tokens_per_step"]["mean"] == 100
    assert "| none | 51.0% | 4 | 35.0% | 90.0% | 0.500 | 100 | 0.0 |" in text
    assert "Held: fewer_tokens_to_baseline_best, fewer_zero_advantage_groups, test_accuracy_at_best_validation." in text
    assert (tmp_path / "docs" / "curriculum.png").stat().st_size > 0 and (tmp_path / "docs" / "curriculum.md").is_file()


def test_a_seed_that_never_reaches_the_target_keeps_the_claim_from_being_held(tmp_path):
    dirs = {}
    for seed in range(3):
        dirs[("none", seed)] = write_run(tmp_path / f"n{seed}", [100] * 4, [0.5] * 4, {2: (0.4, 0.3), 4: (0.6, 0.3)})
        reached = seed < 2
        dirs[("trajectory", seed)] = write_run(
            tmp_path / f"t{seed}", [50 + seed] * 4, [0.4] * 4, {2: (0.6 if reached else 0.5, 0.3), 4: (0.5, 0.3)}
        )
    text = efficiency.write_report(study(), {k: efficiency.run_values(d) for k, d in dirs.items()}, tmp_path / "docs")
    res = json.loads((tmp_path / "docs" / "curriculum.json").read_text())
    tokens = res["claims"][0]
    assert tokens["missed"] == [2] and tokens["seeds"] == [0, 1] and tokens["differences"] == [300, 298]
    assert tokens["interval"]["low"] > 0 and tokens["verdict"] == "inconclusive"
    assert "(never reached by seed 2)" in text
    assert efficiency.tokens_to_reach(efficiency.run_values(dirs[("trajectory", 2)]), 0.6) is None


def test_an_efficiency_metric_needs_the_efficiency_report(tmp_path):
    raw = yaml.safe_load(open(os.path.join(ROOT, "configs", "studies", "toy", "curriculum.yaml")))
    raw["report"] = "long_runs"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    wanted = r"claims\[0\] \(fewer_tokens_to_baseline_best\): metric: only a study with report: efficiency reads it"
    with pytest.raises(ConfigError, match=wanted):
        load_study(tmp_path / "bad.yaml")
