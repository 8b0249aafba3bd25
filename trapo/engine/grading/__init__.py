"""Grading's processes: Math-Verify (or the task verifier `reward.verifier` names) in worker processes with
hard deadlines, the `Judge` that the reward functions of `trapo.algorithm.rewards` are given.

- verifier.py    the trainer's side: `MathVerifier`, its supervisor started and replaced, its memory of slow answers
- supervisor.py  the supervisor process (`python -m trapo.engine.grading.supervisor`): places, hedges and times items
- executor.py    the executors the supervisor forks: Math-Verify with a parse cache, the numeric pre-filter, the alarm
- protocol.py    the wire between them: length-prefixed pickles one way, result lines back

Imports nothing here: a supervisor started with `python -m` would otherwise find its module imported already.
"""
