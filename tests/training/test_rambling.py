"""The rambling guard (trapo/training/rambling.py): truncation and entropy jumping together warn in a line that
names the entropy bonus and its knobs; so does a truncated share that stays at or above
rollout.rambling.loop_truncated for rollout.rambling.loop_steps steps whatever the entropy (a loop), naming
rollout.max_tokens and loss.overlong too. Such steps are not checkpointed, never lower the entropy baseline,
and rollout.rambling.stop_steps of them in a row stop the run; either signal alone, briefly, is no signature.
End to end: a toy run whose every answer runs to the limit is stopped, and its last good checkpoint resumes."""

import os

import pytest
from toyrun import metrics, overrides, train

from trapo import console
from trapo.config import RamblingConfig, load_config
from trapo.training.rambling import RamblingGuard

LAST = lambda: "outputs/run/checkpoints/step-4"  # noqa: E731


def guard(**cfg) -> RamblingGuard:
    return RamblingGuard(RamblingConfig(**cfg), load_config(None, ["toy.enabled=true"]).loss)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(console, "_warned", set())


def test_the_guard_warns_once_skips_saves_and_stops_after_consecutive_steps(capsys):
    g = guard(truncated=0.2, entropy_factor=2.0, stop_steps=3)
    assert g.check(1, 0.0, 0.12, LAST) == (True, None)
    assert g.check(2, 0.0, 0.10, LAST) == (True, None) and g.baseline == 0.10  # the lowest so far
    assert g.check(3, 0.9, 0.15, LAST) == (True, None)  # truncation alone (long answers): no signature
    assert g.check(4, 0.1, 0.90, LAST) == (True, None)  # entropy alone: none either
    assert g.baseline == 0.10 and capsys.readouterr().err == ""
    assert g.check(5, 0.3, 0.25, LAST) == (False, None)  # 0.3 >= 0.2 and 0.25 >= 2 x 0.10: not saved
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "step 5" in warning[0] and "entropy" in warning[0]
    assert "loss.entropy_coef=0.01, loss.agg=dr_grpo, loss.entropy_agg=loss" in warning[0]
    assert "loss.entropy_target" in warning[0] and "token_mean" in warning[0]
    assert g.check(6, 0.6, None, LAST) == (False, None)  # no trained token: no evidence, the streak stays
    assert g.check(7, 0.0, 0.11, LAST) == (True, None) and g.streak == 0  # recovered
    assert g.check(8, 0.5, 0.5, LAST)[1] is None and g.check(9, 0.9, 1.1, LAST)[1] is None
    savable, line = g.check(10, 1.0, 1.3, LAST)
    assert not savable and line.startswith("stopping at step 10: 100% of responses hit rollout.max_tokens")
    assert "entropy is 1.3 nats, 13.0x the run's lowest (0.1)" in line and "3 steps in a row" in line
    assert "last good checkpoint: outputs/run/checkpoints/step-4" in line
    assert capsys.readouterr().err.count("warning") == 0  # warned once per run


def test_warn_only_saves_and_off_is_silent(capsys):
    g = guard(stop_steps=None)
    g.check(1, 0.0, 0.1, LAST)
    assert all(g.check(s, 1.0, 1.0, LAST) == (True, None) for s in range(2, 20))  # warns, never stops
    assert capsys.readouterr().err.count("warning") == 1
    off = guard(truncated=None)
    off.check(1, 0.0, 0.1, LAST)
    assert off.check(2, 1.0, 5.0, LAST) == (True, None) and capsys.readouterr().err == ""


def test_the_baseline_and_streak_survive_a_resume():
    g = guard(stop_steps=2)
    g.check(1, 0.0, 0.1, LAST)
    g.check(2, 1.0, 1.0, LAST)
    resumed = guard(stop_steps=2)
    resumed.load_state_dict(g.state_dict())
    assert resumed.check(3, 1.0, 1.0, LAST)[1].startswith("stopping at step 3")


def test_a_loop_at_low_entropy_is_flagged_after_loop_steps_and_stops_the_run(capsys):
    g = guard(truncated=0.2, entropy_factor=2.0, loop_truncated=0.9, loop_steps=4, stop_steps=3)
    assert g.check(1, 0.0, 0.10, LAST) == (True, None)
    # every answer at the limit, the entropy falling: no signature, saved until the loop has lasted 4 steps
    assert [g.check(s, 0.95, 0.05, LAST) for s in (2, 3, 4)] == [(True, None)] * 3 and g.baseline == 0.05
    assert g.check(5, 1.0, 0.03, LAST) == (False, None)  # the 4th step at or above 0.9: flagged, not saved
    assert g.baseline == 0.05  # a flagged step does not lower the baseline
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "step 5: 100% of responses hit rollout.max_tokens" in warning[0]
    assert "at least 90% for 4 steps in a row" in warning[0] and "loss.overlong=soft_penalty" in warning[0]
    assert "loss.entropy_coef=0.01, loss.agg=dr_grpo, loss.entropy_agg=loss" in warning[0]
    assert g.check(6, 0.92, None, LAST) == (False, None)  # no trained token: the share alone still counts
    savable, line = g.check(7, 0.97, 0.02, LAST)
    assert not savable and line.startswith("stopping at step 7: 97% of responses hit rollout.max_tokens")
    assert "3 steps in a row (rollout.rambling)" in line and "rollout.max_tokens if its answers need" in line
    assert "loss.overlong" in line and "loss.entropy_coef" in line and "loss.entropy_agg" in line
    assert "last good checkpoint: outputs/run/checkpoints/step-4" in line and "\n" not in line


def test_a_dip_below_loop_truncated_restarts_the_count_and_the_loop_needs_the_guard():
    g = guard(truncated=0.2, loop_truncated=0.9, loop_steps=3, stop_steps=2)
    g.check(1, 0.0, 0.1, LAST)
    assert [g.check(s, share, 0.1, LAST)[0] for s, share in enumerate([0.95, 0.95, 0.5, 0.95, 0.95], 2)] == [True] * 5
    assert g.check(7, 0.95, 0.1, LAST) == (False, None)  # 3 in a row since the dip
    assert g.check(8, 0.5, 0.1, LAST) == (True, None) and g.streak == 0  # recovered
    off = guard(truncated=0.2, loop_truncated=None, loop_steps=1)  # the loop rule off: the signature only
    off.check(1, 0.0, 0.1, LAST)
    assert all(off.check(s, 1.0, 0.1, LAST) == (True, None) for s in range(2, 30))
    silent = guard(truncated=None, loop_steps=1)  # the guard off: the loop rule too
    assert all(silent.check(s, 1.0, 0.1, LAST) == (True, None) for s in range(1, 30))


def test_the_warning_repeats_every_50_steps_while_steps_stay_flagged(capsys):
    g = guard(loop_truncated=0.9, loop_steps=1, stop_steps=None)
    assert all(g.check(s, 1.0, 0.1, LAST) == (True, None) for s in range(1, 121))  # warn only: saved
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert [w.split(":")[1].strip() for w in warnings] == ["step 1", "step 51", "step 101"]


def test_a_checkpoint_from_before_the_loop_rule_loads_and_the_loop_count_survives_a_resume():
    old = guard(loop_steps=3, stop_steps=1)
    old.load_state_dict({"baseline": 0.1, "streak": 0})  # what a guard saved before the loop counters
    assert (old.baseline, old.streak, old.looping, old.warned) == (0.1, 0, 0, None)
    g = guard(loop_steps=3, stop_steps=1)
    g.check(1, 0.95, 0.1, LAST)
    g.check(2, 0.95, 0.1, LAST)
    resumed = guard(loop_steps=3, stop_steps=1)
    resumed.load_state_dict(g.state_dict())
    assert resumed.check(3, 0.95, 0.1, LAST)[1].startswith("stopping at step 3")


@pytest.mark.toy_run
def test_a_toy_run_whose_answers_all_run_to_the_limit_stops_and_resumes_from_its_last_good_step(toy_dir, tmp_path):
    # every answer cut at 4 tokens from step 1 (no stop token before them): a loop, at whatever entropy; the
    # health guard stays on (the policy's log-probs are stop-masked as the engine's)
    loop = {"rollout.max_tokens": 4, "rollout.min_tokens": 4}
    guard = {"rollout.rambling.loop_steps": 2, "rollout.rambling.stop_steps": 2}
    args = overrides(toy_dir, tmp_path, run_name="loop", max_steps=8, save_steps=1, **loop, **guard)
    out = train(args, check=False)
    stops = [line for line in out.stderr.splitlines() if "stopping" in line]
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(stops) == 1 and stops[0].split("stopping")[0].strip() == "[trapo]", out.stderr[-3000:]
    assert "stopping at step 3: 100% of responses hit rollout.max_tokens" in stops[0]
    assert "loss.overlong" in stops[0] and "loss.entropy_coef" in stops[0]
    assert "last good checkpoint: " in stops[0] and stops[0].endswith(os.path.join("checkpoints", "step-1"))
    logged = metrics(tmp_path / "loop")
    assert [r["step"] for r in logged] == [1, 2, 3] and all(r["truncated_frac"] == 1.0 for r in logged)
    assert sorted(os.listdir(tmp_path / "loop" / "checkpoints")) == ["step-1"]  # steps 2 and 3 were flagged
    # the fix the line names (room for the answers), resumed from the last good checkpoint: the run goes on
    fixed = {
        "rollout.max_tokens": 12,
        "rollout.min_tokens": 0,
        "resume_changes": "[rollout.max_tokens,rollout.min_tokens]",
    }
    args = overrides(
        toy_dir, tmp_path, run_name="loop", max_steps=4, resume_from="latest", **{**loop, **guard, **fixed}
    )
    train(args)
    assert [r["step"] for r in metrics(tmp_path / "loop")] == [1, 2, 3, 4]
