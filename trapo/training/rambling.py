"""The rambling guard: is the policy writing until the token limit, from the entropy bonus or in a loop?

    guard = RamblingGuard(cfg.rollout.rambling, cfg.loss)
    savable, stop = guard.check(step, step_log["truncated_frac"], step_log["entropy"], last_checkpoint)
    ... log the step ...; if stop: raise TrainingError(stop)

The signature (docs/policy-update.md, measured on the toy): within a few steps the share of responses cut at
rollout.max_tokens jumps from ~0 to ~1 while the mean token entropy rises several-fold. Under Dr.GRPO the bonus
is a sum over tokens with a constant denominator, so every extra high-entropy token adds to it. A step shows
the signature when its truncated share is at least `truncated` and its entropy at least `entropy_factor` x the
lowest entropy of the run's unflagged steps so far (the run's own baseline: no absolute entropy fits every
model). A policy can also loop until the limit at low entropy (deterministic repetition), which no entropy
rise shows: a step whose share is at least `truncated` is flagged as well once the share has stayed at or
above `loop_truncated` for `loop_steps` steps in a row. A flagged step prints a warning line naming the cause
and the knobs (again at most every `WARN_EVERY` steps while flags go on), is not checkpointed (a resume never
starts from a rambling policy), and `stop_steps` of them in a row stop the run with one line that names the
last good checkpoint, as the rollout health guard (trapo/training/health.py) does.
"""

from __future__ import annotations

from trapo import console
from trapo.config import LossConfig, RamblingConfig

WARN_EVERY = 50  # steps between two warnings while steps stay flagged: seen in a long log, not on every line


class RamblingGuard:
    def __init__(self, cfg: RamblingConfig, loss: LossConfig):
        self.cfg = cfg
        self.bonus = (
            f"loss.entropy_coef={loss.entropy_coef:g}, loss.agg={loss.agg}, loss.entropy_agg={loss.entropy_agg}"
            + ("" if loss.entropy_target is None else f", loss.entropy_target={loss.entropy_target:g}")
        )
        self.overlong = loss.overlong
        self.baseline: float | None = None  # the lowest entropy of the unflagged steps so far
        self.streak = 0  # consecutive flagged steps
        self.looping = 0  # consecutive steps with a truncated share at or above loop_truncated
        self.warned: int | None = None  # the step of the last warning

    def state_dict(self) -> dict:
        return {"baseline": self.baseline, "streak": self.streak, "looping": self.looping, "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.baseline, self.streak = state["baseline"], state["streak"]
        # a checkpoint written before the loop rule holds neither: no loop seen, no warning given yet
        self.looping, self.warned = state.get("looping", 0), state.get("warned")

    def signature(self, truncated: float, entropy: float | None) -> bool:
        """Whether a step's truncated share and mean token entropy show the entropy bonus's signature (pure,
        before the baseline takes this step's entropy)."""
        c = self.cfg
        if c.truncated is None or entropy is None or self.baseline is None or truncated < c.truncated:
            return False
        return entropy >= c.entropy_factor * self.baseline

    def loop(self, truncated: float) -> bool:
        """Whether the step ends a run of `loop_steps` steps whose truncated share stayed at or above
        `loop_truncated` (pure: `looping` counts the steps before this one)."""
        c = self.cfg
        if c.truncated is None or c.loop_truncated is None or truncated < max(c.truncated, c.loop_truncated):
            return False
        return self.looping + 1 >= c.loop_steps

    def check(self, step: int, truncated: float, entropy: float | None, last_checkpoint) -> tuple[bool, str | None]:
        """(whether step `step` may be checkpointed, the line to stop the run with). `entropy` None or 0 (no
        trained token this step) is no evidence for the signature either way; the truncated share always is
        for the loop."""
        entropy = entropy or None
        bonus, loop = self.signature(truncated, entropy), self.loop(truncated)
        c = self.cfg
        high = c.loop_truncated is not None and truncated >= c.loop_truncated
        self.looping = self.looping + 1 if high else 0
        if not (bonus or loop):
            if entropy is not None:
                self.baseline = entropy if self.baseline is None else min(self.baseline, entropy)
                self.streak = 0
            return self.streak == 0, None
        self.streak += 1
        seen, knobs = self._why(truncated, entropy, bonus, loop)
        if self.warned is None or step - self.warned >= WARN_EVERY:
            self.warned = step
            console.say(f"warning: step {step}: {seen}: {knobs}")
        if c.stop_steps is None:
            return True, None
        if self.streak >= c.stop_steps:
            return False, (
                f"stopping at step {step}: {seen}, for {self.streak} steps in a row (rollout.rambling): {knobs}. "
                f"These steps were not saved; last good checkpoint: {last_checkpoint() or 'none'}"
            )
        shown = "no trained token" if entropy is None else f"{entropy:.3g}"
        console.say(
            f"step {step}: rambling (truncated {truncated:.0%}, entropy {shown}): not checkpointed "
            f"({self.streak} of {c.stop_steps} before the run stops)"
        )
        return False, None

    def _why(self, truncated: float, entropy: float | None, bonus: bool, loop: bool) -> tuple[str, str]:
        """What the step shows and what to turn: the loop's knobs (the entropy bonus's among them) once the
        share has stayed at the limit, else the entropy bonus's."""
        seen = f"{truncated:.0%} of responses hit rollout.max_tokens"
        if bonus:
            seen += (
                f" and the mean token entropy is {entropy:.3g} nats, "
                f"{entropy / self.baseline:.1f}x the run's lowest ({self.baseline:.3g})"
            )
        elif entropy is not None:
            seen += f" (mean token entropy {entropy:.3g} nats)"
        if not loop:
            return seen, (
                f"the entropy bonus ({self.bonus}) is likely making the policy ramble to the token limit; "
                "lower loss.entropy_coef (0 is veRL's default), set loss.entropy_agg=token_mean, or set "
                "loss.entropy_target (adaptive control); docs/policy-update.md"
            )
        seen += f", at least {self.cfg.loop_truncated:.0%} for {self.looping} steps in a row"
        return seen, (
            "the policy likely loops until the token limit; raise rollout.max_tokens if its answers need more "
            f"room, set loss.overlong=soft_penalty or mask (now {self.overlong}) to stop rewarding or training on "
            f"cut answers, or check the entropy bonus ({self.bonus}: loss.entropy_coef, loss.entropy_agg, "
            "loss.entropy_target); docs/policy-update.md"
        )
