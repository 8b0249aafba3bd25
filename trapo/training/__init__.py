"""The training loop: one step's phases, and what a run records.

- trainer.py           the step: rollouts -> grading -> pass rates and the gate -> update -> weight push -> log
- run_state.py         where the run stands and what a checkpoint holds: save, resume, prune
- inputs.py            a run's inputs (model directory, questions, prompts, benchmarks), checked before any load
- grading.py           a round's rewards, (pseudo) pass rates and confidence scores
- sampling.py          which groups a step trains on (DAPO dynamic sampling), the epoch's data cursor
- rollout_source.py    where a step's rollouts come from: this rank's engine, or (separate) the rollout ranks'
- prefetch.py          separate placement: which rounds are asked for ahead, and the staleness they train at
- rollout_worker.py    a rollout rank's loop: open its engine (hf or vLLM), load weights as they come, answer in order
- update.py            shaped rewards -> advantages -> update batches -> optimizer steps
- settings.py          the config cut into what the engine and the math run: the loss's rules, the engine's sizing
- evaluation.py        generate, grade, score benchmarks: the trainer's Evaluator; `python -m trapo eval` above
- preemption.py        SIGTERM / SIGINT: finish the step, save, stop
- run_record.py        one run per run directory (a lock), resumes that keep the first config, starts.jsonl
- health.py            the rollout engine's health: logprob_diff_rollout_vs_policy watched every step
- rambling.py          the rambling guard: truncated share with an entropy jump (the entropy bonus), or a loop
- metrics.py           a step's statistics, metrics.jsonl, the run's summary
- loggers.py           TensorBoard (tensorboard_writer.py), wandb and MLflow behind one object
- rollout_dump.py      what the policy wrote and how it was scored, every `logging.rollouts_every` steps

May import: trapo.engine, trapo.algorithm and the shared vocabulary; never trapo.commands.
"""
