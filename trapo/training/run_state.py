"""Where a run stands, and what a checkpoint holds: the trainer's `RunState`.

A checkpoint (trapo/engine/checkpoint.py: DeepSpeed's files, the RNGs, atomic directories) holds the policy's
weights and optimizer and, beside them, this object's `state_dict`: the step and the data cursor, the
pass-rate tracker (and the labels bought: labels.*), the bad-step count, the rambling guard and the adaptive
entropy coefficient, the last selection, the best validation score, the held-out scores before training, the
experiment trackers' run ids, the grader's memory and the rounds in flight (rollout.placement separate). `save`
writes, verifies and prunes checkpoints; `resume` restores the newest whole one, weights included, and hands
them to the rollout engine.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from trapo import console
from trapo.algorithm.acquisition import LabelBuyer
from trapo.algorithm.entropy_control import EntropyControl
from trapo.algorithm.passrate import PassRateTracker
from trapo.config import Config, ConfigError
from trapo.engine import checkpoint as ckpt
from trapo.engine import dist
from trapo.engine.grading.verifier import merged
from trapo.engine.policy import Policy, TrainingError
from trapo.training import metrics, run_record
from trapo.training.rambling import RamblingGuard
from trapo.training.rollout_source import RolloutSource
from trapo.training.sampling import Cursor


class RunState:
    """The loop's state (`step`, `cursor`, `tracker`, ...) and the parts whose state a checkpoint also keeps:
    the policy (weights, optimizer), the grader (its memory) and the rollout source (rounds in flight)."""

    def __init__(
        self,
        cfg: Config,
        labeled: torch.Tensor,
        hidden_gold: torch.Tensor,
        *,
        rank: int,
        world: int,
        steps_per_epoch: int,
        total_steps: int,
        policy: Policy,
        tokenizer,
        verifier,  # the grader: its memory of what exhausted the Math-Verify timeout is kept
        rollouts: RolloutSource,
        model_commit: str | None,
    ):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.run_dir = cfg.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.policy, self.tokenizer, self.verifier, self.rollouts = policy, tokenizer, verifier, rollouts
        self.model_commit = model_commit  # a hub model's resolved revision (None: a local directory)
        selection = cfg.selection
        if selection.random_seed is None:  # the random-selection control follows the run's seed
            selection = dataclasses.replace(selection, random_seed=cfg.seed)
        self.tracker = PassRateTracker(labeled, selection)
        # labels.*: the epoch ends that buy labels are the run's but its last
        epochs = math.ceil(cfg.max_steps / steps_per_epoch) if cfg.max_steps else cfg.epochs
        self.labels = LabelBuyer(cfg.labels, cfg.rollout.n, hidden_gold, cfg.seed, buy_epochs=epochs - 1)
        self.step = 0
        self.cursor = Cursor(0, 0)  # the next step's epoch and batch (refills consume batches)
        self.bad_steps = 0  # consecutive skipped (non-finite) updates
        self.rambling = RamblingGuard(cfg.rollout.rambling, cfg.loss)  # stops a run the entropy bonus makes ramble
        self.entropy_control = EntropyControl.from_config(cfg.loss)  # loss.entropy_target's coefficient, or None
        self.last_selection: dict | None = None  # the tracker's diagnostics at the last epoch end
        self.best: dict | None = None  # {"step", "score"} of the best validation score so far
        self.heldout_before: dict | None = None  # held-out scores at step 0 (kept across resumes for the summary)
        self.heldout_avg_before: dict | None = None  # and their avg@eval.heldout_k (eval.heldout_k > 0)
        self.tracker_ids: dict = {}  # the wandb / MLflow run ids: those a resumed run continues, or opened now

    # ------------------------------------------------------------------ how far the run is

    def finished(self, step: int | None = None, cursor: Cursor | None = None) -> bool:
        """max_steps steps done, or without max_steps `epochs` epochs (refills make them fewer steps); at the
        current step and cursor, or at those of a round asked for ahead."""
        step, cursor = self.step if step is None else step, cursor or self.cursor
        return step >= self.cfg.max_steps if self.cfg.max_steps else cursor.epoch >= self.cfg.epochs

    def progress(self) -> tuple[int, int]:
        """(done, total) for the progress bar: steps under max_steps, else batches of the epochs consumed."""
        if self.cfg.max_steps:
            return self.step, self.cfg.max_steps
        return self.cursor.epoch * self.steps_per_epoch + self.cursor.batch, self.total_steps

    # ------------------------------------------------------------------ what a checkpoint holds

    def state_dict(self) -> dict:
        """What a checkpoint restores besides the weights, optimizer and RNGs (see trapo/engine/checkpoint.py)."""
        return {
            "step": self.step,
            "cursor": [self.cursor.epoch, self.cursor.batch],
            "tracker": self.tracker.state_dict(),  # with the bought questions (labels.*)
            "labels": self.labels.state_dict(),  # labels.acquire=care: the epoch's votes, the calibration
            "bad_steps": self.bad_steps,
            "rambling": self.rambling.state_dict(),  # the guard's entropy baseline, streaks and last warning
            "entropy_coef": self.entropy_control and self.entropy_control.state_dict(),  # loss.entropy_target
            "last_selection": self.last_selection,
            "best": self.best,
            "heldout_before": self.heldout_before,
            "heldout_avg_before": self.heldout_avg_before,
            "world_size": self.world,
            "tracker_ids": self.tracker_ids,
            "model_commit": self.model_commit,
            "base_model": self.policy.base,  # model.lora: the frozen base the adapters belong to (path, sha256)
            # each rank's memory of what exhausted the Math-Verify timeout: remembered verdicts survive a resume
            "grader_memory": dist.all_gather(self.verifier.memory()),
            **self.rollouts.state_dict(),  # separate: the rounds generated ahead and not yet trained on
        }

    def load_state_dict(self, state: dict) -> None:
        problem = run_record.model_problem(self.cfg.model, state, self.model_commit, self.policy.base)
        if problem:  # the checkpoint's weights belong to another model: the input to fix
            raise ConfigError(problem)
        self.tracker.load_state_dict(state["tracker"])
        self.labels.load_state_dict(state.get("labels"))
        self.step = state["step"]
        self.cursor = Cursor(*state["cursor"])
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

    # ------------------------------------------------------------------ checkpoints on disk

    def save(self) -> Path:
        """The checkpoint of the current step: written, verified, committed; then best.json and the pruning."""
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
        if self.rank == 0 and self.best is not None:
            ckpt.write_best(self.run_dir / "best.json", self.ckpt_root, self.best)
        self.prune()
        return final

    def prune(self) -> None:
        """keep_checkpoints newest, and the best one (rank 0); after every save and when a run resumes,
        so a lowered keep_checkpoints frees the disk before the next save needs it."""
        if self.rank == 0:
            best_step = None if self.best is None else self.best["step"]
            ckpt.prune(self.ckpt_root, self.cfg.keep_checkpoints, protect=best_step)
        dist.barrier()

    def resume(self) -> tuple[Path | None, int | None]:
        """resume_from's checkpoint restored, its weights pushed into the engine: (the checkpoint, its world
        size when it differs from this run's); (None, None) when the run starts fresh."""
        # Verified before loading: a damaged newest checkpoint is set aside for the newest whole one.
        path = ckpt.choose(self.cfg.resume_from, self.ckpt_root, self.rank, self.world, warn=console.say)
        if path is None:
            if self.cfg.resume_from == "latest":
                console.say(f"resume_from: latest: no checkpoint under {self.ckpt_root} yet, starting fresh")
            return None, None
        state = ckpt.read_trainer_state(path)
        try:
            self.load_state_dict(state)
        except TrainingError as err:
            raise TrainingError(f"{path}: {err}") from None
        saved_world, moved_from = state["world_size"], None
        if saved_world != self.world:  # the optimizer state is consolidated and cut anew, never reset
            console.say(f"{path} was saved with {saved_world} ranks; resuming with {self.world}")
            moved_from = saved_world
        ckpt.restore(path, rank=self.rank, engine=self.policy.engine, saved_world=saved_world, world=self.world)
        self.prune()
        self.rollouts.restore(state, self.step)  # separate: the saved rounds come first; the push is version `step`
        self.rollouts.push_weights()
        if self.rank == 0:
            for log in ("metrics.jsonl", "labels.jsonl"):
                metrics.trim_metrics(self.run_dir / log, self.step)
        console.say(f"resumed from {path} at step {self.step}")
        return path, moved_from

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, for the lines that name it."""
        done = ckpt.list_complete(self.ckpt_root)
        return done[-1][1] if done else None
