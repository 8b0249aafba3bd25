"""The guard on the rollout engine's health (trapo/training/health.py): warn above rollout.health.warn, never
checkpoint a step above rollout.health.stop, stop after rollout.health.steps such steps in a row; and end to end
with the push_noise fault (trapo/faults.py), which corrupts every weight push."""

import os
import sys

import pytest
from toyrun import VLLM, metrics, overrides, run, train

from trapo import faults, runtime
from trapo.config import HealthConfig
from trapo.training.health import RolloutHealth


def test_the_guard_warns_skips_saves_and_stops_after_consecutive_steps():
    guard = RolloutHealth(HealthConfig(warn=0.1, stop=1.0, steps=3))
    last = lambda: "outputs/run/checkpoints/step-4"  # noqa: E731
    assert guard.check(1, 1e-7, last) == (True, None)
    assert guard.check(2, 0.5, last) == (True, None)  # warned, still saved
    assert guard.check(3, 5.0, last) == (False, None)  # suspect: not saved
    assert guard.check(4, None, last) == (False, None)  # no trained token: no evidence, the streak stays
    assert guard.check(5, 0.01, last) == (True, None)  # recovered: the streak ends
    assert guard.check(6, 5.0, last)[1] is None and guard.check(7, 6.0, last)[1] is None
    savable, line = guard.check(8, 66.0, last)
    assert not savable and line.startswith("stopping at step 8: logprob_diff_rollout_vs_policy = 66 nats")
    assert "3 steps in a row" in line and "last good checkpoint: outputs/run/checkpoints/step-4" in line
    assert RolloutHealth(HealthConfig(warn=None, stop=None)).check(1, 1e3, last) == (True, None)  # switched off


@pytest.mark.toy_run
def test_a_corrupted_weight_push_stops_the_run_in_one_line_without_saving_the_drifted_steps(toy_dir, tmp_path):
    env = runtime.subprocess_env(**faults.env("push_noise"))
    args = overrides(toy_dir, tmp_path, run_name="noise", max_steps=10, save_steps=1, mode="trapo", **VLLM)
    out = run([sys.executable, "trapo_train.py", *args], env=env)
    lines = [
        line for line in out.stderr.splitlines() if "logprob_diff_rollout_vs_policy" in line and "stopping" in line
    ]
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        len(lines) == 1
        and "logprob_diff_rollout_vs_policy" in lines[0]
        and "last good checkpoint" in lines[0]
        and "step-1" in lines[0]
    ), out.stderr[-3000:]
    logged = metrics(tmp_path / "noise")
    assert logged[0]["logprob_diff_rollout_vs_policy"] < 1e-4  # step 1 sampled from the weights on disk
    drifted = [r["step"] for r in logged if r["logprob_diff_rollout_vs_policy"] > 1.0]
    assert drifted == [2, 3, 4] and logged[-1]["step"] == 4  # stopped within rollout.health.steps = 3
    assert sorted(os.listdir(tmp_path / "noise" / "checkpoints")) == ["step-1"]  # nothing saved after the drift
    clean = train(overrides(toy_dir, tmp_path, run_name="clean", max_steps=2, mode="trapo", **VLLM))  # no fault
    assert clean.returncode == 0 and all(
        r["logprob_diff_rollout_vs_policy"] < 1e-4 for r in metrics(tmp_path / "clean")
    )


@pytest.mark.toy_run
def test_a_corrupted_push_is_stopped_when_nothing_trains(toy_dir, tmp_path):
    """The toy's own loss settings (no entropy bonus, zero-advantage sequences skipped): the corrupted engine
    answers every question wrong, so no sequence trains; the guard scores a few answers itself and stops."""
    env = runtime.subprocess_env(**faults.env("push_noise"))
    args = overrides(
        toy_dir, tmp_path, run_name="idle", max_steps=10, save_steps=1, mode="trapo", **{"loss.entropy_coef": 0}, **VLLM
    )
    out = run([sys.executable, "trapo_train.py", *args], env=env)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [
        line for line in out.stderr.splitlines() if "stopping" in line and "logprob_diff_rollout_vs_policy" in line
    ]
    assert len(lines) == 1 and "step-1" in lines[0], out.stderr[-3000:]
    logged = metrics(tmp_path / "idle")
    assert all(r["logprob_diff_rollout_vs_policy"] is not None for r in logged)  # measured every step
    assert any(r["trained_sequences"] == 0 for r in logged[1:])  # the probe's case: a step that trains nothing
    assert logged[0]["logprob_diff_rollout_vs_policy"] < 1e-4
    assert logged[-1]["step"] <= 4 and all(r["logprob_diff_rollout_vs_policy"] > 1.0 for r in logged[1:])
    assert sorted(os.listdir(tmp_path / "idle" / "checkpoints")) == ["step-1"]  # nothing saved after the drift
