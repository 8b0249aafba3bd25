"""Adaptive entropy control: the entropy bonus's coefficient moved each step toward a target entropy.

    control = EntropyControl.from_config(cfg.loss)   # None when loss.entropy_target is null
    coef = control.coef                                # the coefficient this step's update uses
    control.update(step_entropy)                       # after the step: the next step's coefficient

The rule (Skywork-OR1's adaptive entropy control, arXiv 2505.22312, section 4): after a step whose mean token
entropy H is below the target, the coefficient rises by `step`; above it, it falls by `step`; equal, it stays.
It is clamped to [0, `max_coef`]. A rambling policy (entropy far above the target) thus sees its bonus
shrink to 0 within coef / step steps, and a collapsing one gets it back. The coefficient is trainer state:
it is checkpointed (trapo/training/run_state.py) so that a resumed run continues the same sequence.
Pure: no tensors, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from trapo.config import LossConfig


@dataclass
class EntropyControl:
    target: float  # nats per response token
    coef: float  # the coefficient the next update uses
    step: float  # how far one step moves it
    max_coef: float  # its upper clamp (the lower one is 0)

    @classmethod
    def from_config(cls, lo: LossConfig) -> EntropyControl | None:
        if lo.entropy_target is None:
            return None
        return cls(lo.entropy_target, lo.entropy_coef, lo.entropy_coef_step, lo.entropy_coef_max)

    def update(self, entropy: float | None) -> float:
        """The coefficient after a step whose mean token entropy was `entropy` (None: no trained token, no
        evidence, unchanged)."""
        if entropy is not None and entropy != self.target:
            moved = self.coef + (self.step if entropy < self.target else -self.step)
            self.coef = min(max(moved, 0.0), self.max_coef)
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
