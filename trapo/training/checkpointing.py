"""What a `Trainer` keeps across a restart: its state beside the weights, the checkpoint written, verified and
pruned, and the resume from one (DeepSpeed's files, RNGs and atomic directories: trapo/engine/checkpoint.py).

A mixin of `trapo.training.trainer.Trainer`, whose attributes it reads and restores: the step and data
cursor, the pass-rate tracker, the rambling guard and the adaptive entropy coefficient, the best validation
score, the held-out score before training, the experiment trackers' ids and the grader's memory.
"""

from __future__ import annotations

from pathlib import Path

from trapo import console
from trapo.config import ConfigError
from trapo.engine import checkpoint as ckpt
from trapo.engine import dist
from trapo.engine.grading.verifier import merged
from trapo.engine.policy import TrainingError
from trapo.training import metrics, run_record, sampling


class Checkpointing:
    def state_dict(self) -> dict:
        """What a checkpoint restores besides the weights, optimizer and RNGs (see trapo/engine/checkpoint.py)."""
        return {
            "step": self.step,
            "cursor": [self.cursor.epoch, self.cursor.batch],
            "tracker": self.tracker.state_dict(),
            "bad_steps": self.bad_steps,
            "rambling": self.rambling.state_dict(),  # the guard's entropy baseline and streak
            "entropy_coef": self.entropy_control and self.entropy_control.state_dict(),  # loss.entropy_target
            "last_selection": self.last_selection,
            "best": self.best,
            "heldout_before": self.heldout_before,
            "heldout_avg_before": self.heldout_avg_before,
            "world_size": self.world,
            "tracker_ids": self.loggers.ids() or self.tracker_ids,
            "model_commit": self.model_source and self.model_source.commit,  # a hub model's resolved revision
            "base_model": self.policy.base,  # model.lora: the frozen base the adapters belong to (path, sha256)
            # each rank's memory of what exhausted the Math-Verify timeout: remembered verdicts survive a resume
            "grader_memory": dist.all_gather(self.verifier.memory()),
            # rollout.placement separate: the rounds generated ahead and not yet trained on (rank 0 holds them)
            **({"rounds_in_flight": self.rollout.in_flight()} if self.cfg.rollout.placement == "separate" else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        commit = self.model_source and self.model_source.commit
        problem = run_record.model_problem(self.cfg.model, state, commit, self.policy.base)
        if problem:  # the checkpoint's weights belong to another model: the input to fix
            raise ConfigError(problem)
        self.tracker.load_state_dict(state["tracker"])
        self.step = state["step"]
        self.cursor = sampling.Cursor(*state["cursor"])
        self.bad_steps = state["bad_steps"]
        self.rambling.load_state_dict(state["rambling"])
        if self.entropy_control is not None and state["entropy_coef"] is not None:
            self.entropy_control.load_state_dict(state["entropy_coef"])
        self.last_selection = state["last_selection"]
        self.best = state["best"]
        self.heldout_before = state["heldout_before"]
        self.heldout_avg_before = state["heldout_avg_before"]
        self.tracker_ids = state["tracker_ids"]
        memories = state["grader_memory"]  # one per saving rank: merged when the world size changed
        self.verifier.load_memory(memories[self.rank] if len(memories) == self.world else merged(memories))

    def save(self) -> Path:
        final = ckpt.save(
            self.ckpt_root,
            self.step,
            rank=self.rank,
            world=self.world,
            engine=self.policy.engine,
            weights=self.policy.full_weights(),
            trainer_state=self.state_dict(),
            model=self.policy.base_model(),
            tokenizer=self.tokenizer,
            keep=self.cfg.keep_checkpoints,
        )
        if self.is_main and self.best is not None:
            ckpt.write_best(self.run_dir / "best.json", self.ckpt_root, self.best)
        self._prune()
        return final

    def _prune(self) -> None:
        """keep_checkpoints newest, and the best one (rank 0); after every save and when a run resumes,
        so a lowered keep_checkpoints frees the disk before the next save needs it."""
        if self.is_main:
            best_step = None if self.best is None else self.best["step"]
            ckpt.prune(self.ckpt_root, self.cfg.keep_checkpoints, protect=best_step)
        dist.barrier()

    def _resume(self) -> None:
        # Verified before loading: a damaged newest checkpoint is set aside for the newest whole one.
        path = ckpt.choose(self.cfg.resume_from, self.ckpt_root, self.rank, self.world, warn=console.say)
        if path is None:
            if self.cfg.resume_from == "latest":
                console.say(f"resume_from: latest: no checkpoint under {self.ckpt_root} yet, starting fresh")
            return
        state = ckpt.read_trainer_state(path)
        try:
            self.load_state_dict(state)
        except TrainingError as err:
            raise TrainingError(f"{path}: {err}") from None
        saved_world = state["world_size"]
        if saved_world != self.world:  # the optimizer state is consolidated and cut anew, never reset
            console.say(f"{path} was saved with {saved_world} ranks; resuming with {self.world}")
            self.moved_from = saved_world
        ckpt.restore(path, rank=self.rank, engine=self.policy.engine, saved_world=saved_world, world=self.world)
        self._prune()
        if self.cfg.rollout.placement == "separate":  # the saved rounds come first; the push is version `step`
            self.rollout.restore(state.get("rounds_in_flight", []), self.step)
        self.rollout.push_weights(self.policy.full_weights())
        if self.is_main:
            metrics.trim_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.resumed_from = path
        console.say(f"resumed from {path} at step {self.step}")

    def _last_checkpoint(self) -> Path | None:
        done = ckpt.list_complete(self.ckpt_root)
        return done[-1][1] if done else None
