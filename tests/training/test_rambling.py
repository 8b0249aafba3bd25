"""The rambling guard (trapo/training/rambling.py): truncation and entropy jumping together warn once in a line
that names the entropy bonus and its knobs; such steps are not checkpointed and rollout.rambling.stop_steps of
them in a row stop the run; either signal alone is no signature."""

import pytest

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
