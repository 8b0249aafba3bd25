"""The rambling guard: is the entropy bonus teaching the policy to write until the token limit?

    guard = RamblingGuard(cfg.rollout.rambling, cfg.loss)
    savable, stop = guard.check(step, step_log["truncated_frac"], step_log["entropy"], last_checkpoint)
    ... log the step ...; if stop: raise TrainingError(stop)

The signature (docs/policy-update.md, measured on the toy): within a few steps the share of responses cut at
rollout.max_tokens jumps from ~0 to ~1 while the mean token entropy rises several-fold. Under Dr.GRPO the bonus
is a sum over tokens with a constant denominator, so every extra high-entropy token adds to it. A step shows
the signature when its truncated share is at least `truncated` and its entropy at least `entropy_factor` x the
lowest step entropy of the run so far (the run's own baseline: no absolute entropy fits every model). The first
such step prints one warning line naming the cause and the knobs. Such a step is not checkpointed (a resume
never starts from a rambling policy), and `stop_steps` of them in a row stop the run with one line that names
the last good checkpoint, as the rollout health guard (trapo/training/health.py) does.
"""

from __future__ import annotations

from trapo import console
from trapo.config import LossConfig, RamblingConfig


class RamblingGuard:
    def __init__(self, cfg: RamblingConfig, loss: LossConfig):
        self.cfg = cfg
        self.bonus = (
            f"loss.entropy_coef={loss.entropy_coef:g}, loss.agg={loss.agg}, loss.entropy_agg={loss.entropy_agg}"
            + ("" if loss.entropy_target is None else f", loss.entropy_target={loss.entropy_target:g}")
        )
        self.baseline: float | None = None  # the lowest step entropy so far
        self.streak = 0  # consecutive signature steps

    def state_dict(self) -> dict:
        return {"baseline": self.baseline, "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.baseline, self.streak = state["baseline"], state["streak"]

    def signature(self, truncated: float, entropy: float | None) -> bool:
        """Whether a step's truncated share and mean token entropy show the signature (pure, before the
        baseline takes this step's entropy)."""
        c = self.cfg
        if c.truncated is None or entropy is None or self.baseline is None or truncated < c.truncated:
            return False
        return entropy >= c.entropy_factor * self.baseline

    def check(self, step: int, truncated: float, entropy: float | None, last_checkpoint) -> tuple[bool, str | None]:
        """(whether step `step` may be checkpointed, the line to stop the run with). `entropy` None or 0 (no
        trained token this step) is no evidence either way."""
        entropy = entropy or None
        if not self.signature(truncated, entropy):
            if entropy is not None:
                self.baseline = entropy if self.baseline is None else min(self.baseline, entropy)
                self.streak = 0
            return self.streak == 0, None
        self.streak += 1
        c = self.cfg
        seen = (
            f"{truncated:.0%} of responses hit rollout.max_tokens and the mean token entropy is {entropy:.3g} nats, "
            f"{entropy / self.baseline:.1f}x the run's lowest ({self.baseline:.3g})"
        )
        knobs = (
            f"the entropy bonus ({self.bonus}) is likely making the policy ramble to the token limit; "
            "lower loss.entropy_coef (0 is veRL's default), set loss.entropy_agg=token_mean, or set "
            "loss.entropy_target (adaptive control); docs/policy-update.md"
        )
        console.warn_once("rambling", f"step {step}: {seen}: {knobs}")
        if c.stop_steps is None:
            return True, None
        if self.streak >= c.stop_steps:
            return False, (
                f"stopping at step {step}: {seen}, for {self.streak} steps in a row (rollout.rambling): {knobs}. "
                f"These steps were not saved; last good checkpoint: {last_checkpoint() or 'none'}"
            )
        console.say(
            f"step {step}: rambling (truncated {truncated:.0%}, entropy {entropy:.3g}): not checkpointed "
            f"({self.streak} of {c.stop_steps} before the run stops)"
        )
        return False, None
