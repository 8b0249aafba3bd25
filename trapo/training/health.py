"""The rollout engine's health: does it still sample from the policy being trained?

    guard = RolloutHealth(cfg.rollout.health)
    savable, stop = guard.check(step, step_log["logprob_diff_rollout_vs_policy"], last_checkpoint, stale=False)
    ... log the step ...; if stop: raise TrainingError(stop)

The metric is the mean |log pi_policy - log pi_engine| per trained response token, or, in a step that trains
none (every reward equal: what a corrupted push causes), per token of a few of its answers scored without
gradient (trapo/training/update.py, `probe_sequences`): it is measured every step. It stays near zero while
the engine runs the policy's weights, dtype and RoPE, and jumps when a weight push misses or corrupts
parameters. Above `warn` the run warns once. Above `stop` a step is suspect: it is not checkpointed, so a
resume never starts from weights trained on a drifted engine's samples. `steps` suspect steps in a row
stop the run with one line that names the metric, its value, the last good checkpoint and the likely causes.
"""

from __future__ import annotations

from trapo import console
from trapo.config import HealthConfig

METRIC = "logprob_diff_rollout_vs_policy"


class RolloutHealth:
    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.streak = 0  # consecutive steps above cfg.stop

    def check(self, step: int, value: float | None, last_checkpoint, *, stale: bool = False) -> tuple[bool, str | None]:
        """(whether step `step` may be checkpointed, the line to stop the run with after cfg.steps suspect steps
        in a row). `value` None (no answer had the engine's log-probs) is no evidence either way, and said so;
        stale: the step trained on a round of older weights (its drift is the policy's change, not a sync fault),
        no evidence either. `last_checkpoint()` names the newest saved checkpoint, for the line. Every rank sees
        the same value (a sum over ranks)."""
        if value is None and not stale:
            console.say(
                f"step {step}: no evidence for {METRIC}: no answer carried the rollout engine's log-probs, so "
                "the rollout health guard could not check the engine this step"
            )
        if value is None or stale:
            return self.streak == 0, None
        c = self.cfg
        if c.warn is not None and value > c.warn:
            console.warn_once(
                "rollout_health",
                f"step {step}: {METRIC} = {value:.3g} nats, above rollout.health.warn = {c.warn:g}: the rollout "
                "engine's log-probs drift from the policy's (a weight push, dtype or RoPE mismatch?)",
            )
        if c.stop is None or value <= c.stop:
            self.streak = 0
            return True, None
        self.streak += 1
        if self.streak >= c.steps:
            return False, (
                f"stopping at step {step}: {METRIC} = {value:.3g} nats, above rollout.health.stop = {c.stop:g} for "
                f"{self.streak} steps in a row: the rollout engine no longer samples from the policy, and these "
                f"steps were not saved; last good checkpoint: {last_checkpoint() or 'none'}. Likely causes: a "
                "weight push that missed or corrupted parameters, a dtype or RoPE mismatch between engine and "
                "policy (model.dtype, model.rope_theta)"
            )
        console.say(
            f"step {step}: {METRIC} = {value:.3g} above rollout.health.stop = {c.stop:g}: not checkpointed "
            f"({self.streak} of {c.steps} before the run stops)"
        )
        return False, None
