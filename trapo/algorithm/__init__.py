"""The paper's math: what TraPO computes, as functions of tensors and strings.

- loss.py         group advantages (GRPO / Dr.GRPO), DAPO's overlong shaping, the clipped surrogate
                  (paper eq. "grpo"), GSPO and CISPO; `LossSpec`, the run's loss rules decided once, and
                  `PolicyLoss`, the loss built from them that the engine calls per micro-batch
- entropy_control.py  the adaptive entropy coefficient (loss.entropy_target)
- importance.py   rollout importance weights (vLLM's sampler vs the trainer's pi_old)
- logits.py       per-token log-probs, entropy and the LM head's chunked statistics
- passrate.py     pass rates, trajectories, TCS and the reliable database (paper "Progressive Trajectory
                  Guidance"), the gate M
- selection.py    selection strategies at an epoch's end (TCS, random, entropy, self-certainty)
- pass_at_k.py    avg@k and the unbiased pass@k
- rewards/        answer extraction, rewards against a gold, majority vote, confidence rewards; what compares
                  two answers is a judge passed in (rewards/judge.py)

May import: torch, numpy, and the shared vocabulary (trapo.config, trapo.data, trapo.console, trapo.runtime,
trapo.faults). Nothing here loads a model, starts DeepSpeed or vLLM, touches a run directory, or starts a
process: Math-Verify's worker processes are trapo.engine.grading, handed to the rewards as their judge.
"""
