"""The TraPO / GRPO training loop: DeepSpeed ZeRO-3 policy, colocated rollouts, pass-rate gate.

One step, on every rank (each rank takes every world_size-th question of the batch):
    1. rollouts   G samples per question from the rank's own engine (rollout.backend: vLLM, or the policy);
                  rollout.placement separate: from the rollout ranks, asked ahead (trapo/training/prefetch.py)
    2. grading    Math-Verify vs gold (labeled), majority vote (unlabeled)
    3. pass rates gathered from all ranks into the replicated PassRateTracker;
                  the gate M comes from the selection made at the last epoch end;
                  with rollout.dynamic_sampling, groups with equal rewards leave the
                  step and 1-3 repeat on the epoch's next batches (trapo/training/sampling.py)
    4. update     Dr.GRPO advantages, L = J_labeled + M * J_unlabeled, token-budget
                  micro-batches, one DeepSpeed optimizer step per update batch
    5. push       the new weights, gathered block by block, into vLLM (the hf backend is the policy: no push)
    6. log        statistics summed over ranks; at an epoch's end the tracker appends
                  the epoch's pass rates to every trajectory and selects the reliable
                  unlabeled questions for the next epoch
The components do the work: `Policy` (trapo/engine/policy.py), the `RolloutEngine`
(trapo/engine/rollout_engine.py), `grade` (trapo/training/grading.py), `PassRateTracker`
(trapo/algorithm/passrate.py), `trapo.training.metrics` and `trapo.engine.checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import torch

from trapo import console, runtime
from trapo.algorithm.entropy_control import EntropyControl
from trapo.algorithm.loss import PolicyLoss
from trapo.algorithm.passrate import PassRateTracker
from trapo.algorithm.rewards.verifiers import require_verifier
from trapo.algorithm.selection import confidence_kind
from trapo.config import Config, dump_config, to_dict
from trapo.data import stop_token_ids
from trapo.engine import checkpoint as ckpt
from trapo.engine import dist
from trapo.engine.grading.verifier import MathVerifier
from trapo.engine.packing import update_efficiency
from trapo.engine.policy import Policy, TrainingError, same_model
from trapo.engine.rollout import Rollout, require_backend
from trapo.training import curriculum, metrics, prefetch, rollout_dump, run_record, sampling
from trapo.training.checkpointing import Checkpointing
from trapo.training.evaluation import Evaluator
from trapo.training.grading import Grades, confidence_kinds, confidence_scores, grade, round_rewards
from trapo.training.health import METRIC, RolloutHealth
from trapo.training.inputs import fetch_model, prepare_inputs
from trapo.training.loggers import Loggers
from trapo.training.preemption import Preempted, StopSignals
from trapo.training.prefetch import Prefetching
from trapo.training.rambling import RamblingGuard
from trapo.training.settings import engine_settings, loss_spec
from trapo.training.update import update_policy


class Trainer(Checkpointing, Prefetching):
    def __init__(self, cfg: Config):
        # auto: vLLM or hf, chosen here (a resume: the engine it started with); config.yaml records the choice
        self.backend_chosen: list[str] = []  # its line, said with the run's first lines (train)
        cfg = run_record.resolve_backend(cfg, say=self.backend_chosen.append)
        self.cfg = cfg
        require_backend(cfg.rollout.backend, load=False)  # vLLM missing: one line before any work
        require_verifier(cfg.reward.verifier)  # reward.verifier that cannot be imported: the same
        self.rank, self.world, self.local_rank = dist.init_distributed(cfg.dist_timeout_minutes)
        self.is_main = self.rank == 0
        self.run_dir = cfg.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        for notice in runtime.NOTICES:  # what the environment set-up changed, e.g. TORCHDYNAMO_DISABLE on GPU
            console.say(notice)
        # rank 0 owns the directory (one run at a time) before it looks at or cleans anything in it
        dist.on_rank0(lambda: run_record.open_run_dir(self.run_dir, self.ckpt_root, cfg.resume_from))
        resumes = ckpt.resolve(cfg.resume_from, self.ckpt_root)  # a missing resume_from: now
        self.model_source = fetch_model(cfg)  # a hub id: downloaded once per node
        # a resume keeps its record: a changed setting that would alter the run stops it before any load
        settings = to_dict(run_record.as_run(cfg, self.model_source))
        self.changes = run_record.resume_changes(self.run_dir, settings, cfg.resume_changes, resumes) if resumes else {}
        self.resumed_from: Path | None = None  # the checkpoint this start resumed, if any
        self.moved_from: int | None = None  # the world size of that checkpoint, when it differs from this run's
        inputs = prepare_inputs(cfg, self.world, self.model_source and str(self.model_source.local_dir))
        self.model_dir, self.tokenizer = inputs.model_dir, inputs.tokenizer
        self.questions, self.prompts = inputs.questions, inputs.prompts
        self.steps_per_epoch, self.total_steps = inputs.steps_per_epoch, inputs.total_steps
        # A vLLM that fails to import: one line after the input checks (they stay quick), before the model loads
        require_backend(cfg.rollout.backend)
        # the loss, built once: the policy calls it, the update reads its rules
        loss = PolicyLoss(loss_spec(cfg), self.world, on_gpu=torch.cuda.is_available())
        self.policy = Policy(
            self.model_dir,
            self.world,
            self.tokenizer.pad_token_id,
            model=cfg.model,
            train=cfg.train,
            rollout=cfg.rollout,
            loss=loss,
            seed=cfg.seed,
        )
        generation = getattr(self.policy.model, "generation_config", None)
        stops = stop_token_ids(self.tokenizer, generation and generation.eos_token_id)
        settings = engine_settings(cfg, rank=self.rank, world=self.world, overrides=self.policy.overrides)
        self.rollout = self._open_engine(settings, stops)  # rollout.placement separate: the rollout ranks'
        if (engine_config := self.rollout.effective_config()) is not None:  # a separate model must run the policy's
            console.say(same_model(self.policy.effective_config(), engine_config))
        devices = dist.all_gather(self.rollout.device())
        console.say(self.rollout.describe(devices))
        self.verifier = MathVerifier(
            num_workers=cfg.reward.workers, timeout=cfg.reward.timeout, spec=cfg.reward.verifier
        )
        self.evaluator = Evaluator(
            cfg,
            self.rollout,
            self.policy,
            self.tokenizer,
            self.verifier,
            rank=self.rank,
            world=self.world,
            turn=self._engine_turn,
            test=inputs.test_benchmarks,
            validation=inputs.val_benchmarks,
        )
        selection = cfg.selection
        if selection.random_seed is None:  # the random-selection control follows the run's seed
            selection = dataclasses.replace(selection, random_seed=cfg.seed)
        self.tracker = PassRateTracker(torch.tensor([q.labeled for q in self.questions]), selection)
        self.step = 0
        self.cursor = sampling.Cursor(0, 0)  # the next step's epoch and batch (refills consume batches)
        self.bad_steps = 0  # consecutive skipped (non-finite) updates
        self.health = RolloutHealth(cfg.rollout.health)  # stops a run whose engine drifts from the policy
        self.rambling = RamblingGuard(cfg.rollout.rambling, cfg.loss)  # and one the entropy bonus makes ramble
        self.entropy_control = EntropyControl.from_config(cfg.loss)  # loss.entropy_target's coefficient, or None
        self.last_selection: dict | None = None  # the tracker's diagnostics at the last epoch end
        self.best: dict | None = None  # {"step", "score"} of the best validation score so far
        self.heldout_before: dict | None = None  # held-out scores at step 0 (kept across resumes for the summary)
        self.heldout_avg_before: dict | None = None  # and their avg@eval.heldout_k (eval.heldout_k > 0)
        self.loggers = Loggers([])  # TensorBoard, wandb, MLflow (logging.*), opened on rank 0 by train()
        self.tracker_ids: dict = {}  # the wandb / MLflow run ids a resumed run continues
        self._resume()

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict:
        cfg, timer = self.cfg, metrics.StepTimer()
        step_start = time.perf_counter()
        epoch, first = self.cursor.epoch, self.cursor.batch
        self._request_ahead()  # rollout.placement separate: this step's round, and the next max_staleness ones
        # sampling.curriculum: the epoch's batches without the questions it skips (the tracker's plan)
        order, skips = curriculum.epoch_order(cfg, self.tracker, epoch)

        # 1-3. rollouts, grading, pass rates into the tracker and rewards, one round per batch: one batch,
        #      with rollout.dynamic_sampling more of the epoch's until enough groups carry a signal
        rounds, informative, kept = self._rollout_rounds(order, first, timer)
        self._request_ahead(used=len(rounds))  # dynamic sampling: the next step's first round, now it is known
        plan, n_updates = sampling.update_plan(kept, self.rank, self.world, cfg.train.update_batch_size)
        self._dump_rollouts(rounds, plan)  # logging.rollouts_every: what was generated and how it was scored

        # 4. advantages and the update(s) on the kept groups
        with timer.time("update"):
            groups = sampling.take(rounds, plan, self.rank, self.world)
            prompts = [self.prompts[i] for i in groups.question_ids]
            labeled = [self.questions[i].labeled for i in groups.question_ids]
            coef = self.entropy_control and self.entropy_control.coef  # None: the LossSpec's fixed coefficient
            update = update_policy(
                self.policy, cfg, groups, prompts, labeled, step=self.step, n_updates=n_updates, entropy_coef=coef
            )

        # 5. the weights into vLLM (also after a skipped update: a sleeping engine released its copy)
        with timer.time("weight_push"):
            pushed_bytes = self.rollout.push_weights(self.policy.full_weights())

        # 6. statistics over all ranks; at the epoch's end, extend trajectories and select for the next epoch
        totals = dist.all_sum({**update.sums, **self._rollout_sums(rounds, plan)})
        majority = cfg.mode != "supervised" and cfg.reward.unlabeled == "majority"
        step_log = {
            "step": self.step + 1,
            "epoch": epoch + 1,
            **metrics.step_values(
                totals, world=self.world, updates=n_updates, applied=update.applied, majority=majority
            ),
            "selected_unlabeled": int(self.tracker.selected.sum()),  # the gate's current open set
            "pushed_gb": pushed_bytes / 2**30,
            # groups rolled out whose G rewards are all equal (advantage 0), before any dynamic-sampling filter
            "zero_advantage_frac": totals["zero_advantage_groups"] / max(totals["groups"], 1),
            **self._staleness(totals),  # separate: how many updates the rollouts' weights lag the trainer's
            **update_efficiency(update.work),  # signal tokens / tokens computed by all ranks, and the rest's parts
        }
        if self.entropy_control is not None:  # the coefficient this step trained with; then the next step's
            step_log["entropy_coef"] = coef
            self.entropy_control.update(step_log["entropy"] if totals["trained_tokens"] else None)
        if cfg.rollout.dynamic_sampling:
            rolled = sum(len(order[first + i]) for i in range(len(rounds)))
            step_log["dynamic_sampling"] = metrics.dynamic_sampling_values(rolled, informative, len(kept), len(rounds))
        if skips is not None:
            step_log["curriculum"] = curriculum.step_values(skips, order, self.tracker.labeled)
        self.cursor = self.cursor.advance(len(rounds), len(order))
        if self.cursor.epoch > epoch:  # the epoch's batches are used up
            step_log["selection"] = self._end_epoch()
            if skips is not None:  # what the epoch's re-admitted questions showed
                step_log["curriculum"].update(curriculum.epoch_end_values(cfg, self.tracker))
        self.step += 1
        timer.seconds["step"] = time.perf_counter() - step_start
        step_log["timing"] = {name: round(sec, 4) for name, sec in timer.seconds.items()}
        if self.policy.offload_states:  # what moved to host memory for the rollouts, and the copies' time
            moved = self.policy.moved
            step_log["offload"] = {
                "bytes": moved["bytes"],
                **{k: round(moved[k], 5) for k in ("offload_s", "reload_s")},
            }
        if timer.peak_bytes:  # GPU: each phase's peak allocated memory on this rank
            step_log["peak_gb"] = {name: round(b / 2**30, 3) for name, b in timer.peak_bytes.items()}
        step_log["tokens_per_s"] = totals["response_tokens"] / max(timer.seconds["rollout"], 1e-9)
        return step_log

    def _rollout_rounds(self, order: list[list[int]], first: int, timer: metrics.StepTimer) -> tuple[list, int, list]:
        """Roll out batch `first` of the epoch's `order`, and with dynamic sampling the next ones while too few
        groups over all ranks have unequal rewards. Returns (this rank's rounds, informative groups over all
        ranks, the kept groups' keys: all of one batch, or the informative ones cut to the batch size)."""
        r, target = self.cfg.rollout, self.cfg.train.rollout_batch_size
        rounds, keys = [], []
        while True:
            if rounds and self.rollout.weights_asleep:  # GPU: the last round's engine turn released them
                with timer.time("weight_push"):
                    self.rollout.push_weights(self.policy.full_weights())
            rounds.append(self._round(order[first + len(rounds)][self.rank :: self.world], timer))
            if not r.dynamic_sampling:
                return rounds, len(order[first]), [(0, p) for p in range(len(order[first]))]
            flags = dist.all_gather(sampling.informative(rounds[-1].rewards))  # decided alike on every rank
            keys += sampling.round_keys(len(rounds) - 1, flags)
            left = len(order) - first - len(rounds)  # never past the epoch's end
            if not sampling.want_more(len(keys), target, len(rounds), r.dynamic_sampling_max_rounds, left):
                return rounds, len(keys), sampling.cut(keys, target)

    def _round(self, question_ids: list[int], timer: metrics.StepTimer) -> sampling.Round:
        """Rollouts, grades, pass rates (into the tracker, with the gate M) and rewards of this rank's questions."""
        cfg = self.cfg
        questions = [self.questions[i] for i in question_ids]
        # 1. rollouts: G samples per question, each request seeded by (run seed, step, question)
        with timer.time("rollout"):
            rollouts = self._sample(question_ids)  # [b][G]
        # 2. grading: rewards and (pseudo) pass rates
        with timer.time("grading"):
            texts = [[r.text for r in group] for group in rollouts]
            grades = grade(questions, texts, cfg.reward.timeout, self.verifier, budget=cfg.reward.step_budget)
        # 3. pass rates from every rank into the tracker; the gate for this epoch was fixed at the last epoch end
        # (the selection strategy's confidence scores, when it needs them, are a policy forward: timed as grading)
        with timer.time("grading"):
            scored = self._confidence_scores(question_ids, rollouts)  # {kind: {position: [G] scores}}
            gate = self._record_pass_rates(question_ids, grades, scored)  # [b]
            rewards = round_rewards(grades, scored.get(cfg.reward.unlabeled, {}))  # [b][G]
        return sampling.Round(question_ids, rollouts, grades, gate, rewards)

    def _rollout_sums(self, rounds: list[sampling.Round], plan: dict) -> dict[str, float]:
        """`metrics.step_sums` over every question this rank rolled out in the step (refills and filtered
        groups included: they describe the rollouts); the gate counts only for groups kept for the update."""
        sums: dict[str, float] = {}
        for rnd, gate in zip(rounds, sampling.in_loss(rounds, plan, self.rank, self.world)):
            questions = [self.questions[q] for q in rnd.question_ids]
            for name, value in metrics.step_sums(questions, rnd.grades, gate, rnd.rollouts).items():
                sums[name] = sums.get(name, 0) + value
            sums["groups"] = sums.get("groups", 0) + len(questions)  # for zero_advantage_frac
            sums["zero_advantage_groups"] = sums.get("zero_advantage_groups", 0) + sampling.informative(
                rnd.rewards
            ).count(False)
        return sums

    def _dump_rollouts(self, rounds: list[sampling.Round], plan: dict) -> None:
        """logging.rollouts_every: every question the step rolled out (refills included); in_loss is the gate
        for the groups the update keeps and 0 for the others. Rewards are those before any overlong penalty."""
        ids = [q for rnd in rounds for q in rnd.question_ids]
        rollout_dump.dump_step(
            self.cfg.logging.rollouts_every,
            self.run_dir,
            self.step + 1,
            ids,
            [self.questions[q] for q in ids],
            prompts=[self.prompts[q] for q in ids],
            decode=self.tokenizer.decode,
            texts=[[r.text for r in group] for rnd in rounds for group in rnd.rollouts],
            rewards=[rewards for rnd in rounds for rewards in rnd.rewards],
            grades=Grades.concat([rnd.grades for rnd in rounds]),
            gate=[m for gate in sampling.in_loss(rounds, plan, self.rank, self.world) for m in gate],
        )

    def _sample(self, question_ids: list[int]) -> list[list[Rollout]]:
        """G rollouts per question; on GPU the optimizer's states wait in host memory meanwhile."""
        with self._engine_turn():
            return self.rollout.generate(**self._request(self.step, question_ids))

    @contextlib.contextmanager
    def _engine_turn(self):
        """Generation's turn. vLLM on GPU: the trainer's movable states go to host memory first, so that the
        KV cache, woken by `generate`, fits beside what stays; vLLM sleeps (weights and KV cache released)
        before they come back. hf: the policy's ZeRO-3 parameters are gathered once for the whole turn."""
        self.policy.offload()
        try:
            with self.rollout.turn():
                yield
        finally:
            self.policy.reload()

    def _end_epoch(self) -> dict:
        """Extend every trajectory with the epoch's pass rates, select for the next epoch, dump the selection."""
        self.last_selection = self.tracker.end_epoch()
        if self.is_main and self.last_selection["tcs_selected"] is not None:
            path = self.run_dir / "selection.jsonl"  # the first row also carries the warm-up's trajectories
            row = self.tracker.selection_row(history=not path.is_file())
            metrics.append_jsonl(path, row)
            self.loggers.log_selection(row, step=self.step + 1)  # the step that closes the epoch
        return self.last_selection

    def _confidence_scores(self, question_ids: list[int], rollouts: list[list[Rollout]]) -> dict[str, dict]:
        """{kind: {position in the batch: its G confidence scores}} of this rank's unlabeled questions, for the
        kinds the selection strategy and the unlabeled reward need (`grading.confidence_kinds`). Collective."""
        unlabeled = [pos for pos, i in enumerate(question_ids) if not self.questions[i].labeled]
        return confidence_scores(
            self.policy,
            confidence_kinds(self.cfg, self.tracker.labeled),
            unlabeled,
            prompts=[self.prompts[question_ids[pos]] for pos in unlabeled],
            responses=[[r.token_ids for r in rollouts[pos]] for pos in unlabeled],
        )

    def _record_pass_rates(self, question_ids: list[int], grades: Grades, scored: dict[str, dict]) -> list[float]:
        """Gather every rank's pass rates (and the selection strategy's confidence scores, when it ranks by
        them) into the tracker; return the gate M of this rank's questions."""
        confidence = [float("nan")] * len(question_ids)  # [b]: mean over the G responses, unlabeled only
        for pos, scores in scored.get(confidence_kind(self.cfg.selection.strategy), {}).items():
            confidence[pos] = sum(scores) / len(scores)
        gathered = dist.all_gather((question_ids, grades.pass_rates, grades.pseudo_correct, confidence))
        self.tracker.record(
            torch.tensor([i for ids, *_ in gathered for i in ids]),
            torch.tensor([p for _, rates, *_ in gathered for p in rates]),
            torch.tensor([c for _, _, correct, _ in gathered for c in correct]),
            torch.tensor([c for *_, conf in gathered for c in conf]),
        )
        if self.cfg.mode != "trapo":
            return [1.0] * len(question_ids)
        return self.tracker.gate(torch.tensor(question_ids)).tolist()

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        cfg = self.cfg
        if self.is_main:  # the first start's config stays; every start is a line of starts.jsonl
            start = {
                "step": self.step,
                "world": self.world,
                "resumed_from": self.resumed_from,
                "moved_from_world": self.moved_from,
                "changes": self.changes,
            }
            run_record.record_start(self.run_dir, dump_config(run_record.as_run(cfg, self.model_source)), start)
        # every rank: a missing package, or a backend rank 0 cannot start, stops all ranks now, before any step
        self.loggers = Loggers.open_everywhere(cfg, self.is_main, self.tracker_ids)
        for line in self.backend_chosen:
            console.say(line)
        n_labeled = sum(q.labeled for q in self.questions)
        refills = " at most (dynamic sampling: refills consume batches)" if cfg.rollout.dynamic_sampling else ""
        if cfg.sampling.curriculum != "none":  # skipped questions shorten epochs too
            refills = " at most (sampling.curriculum: skipped questions shorten epochs)"
        console.say(
            f"mode {cfg.mode}: {n_labeled} labeled + {len(self.questions) - n_labeled} unlabeled questions, "
            f"{self.steps_per_epoch} steps per epoch, {self.total_steps} steps{refills}, world size {self.world}"
        )
        if self.step == 0:
            self.heldout_before = self.evaluator.heldout()
            if self.heldout_before is not None:
                console.say(f"held-out accuracy before training: {self.heldout_before['mean']:.3f}")
            self.heldout_avg_before = self.evaluator.heldout_avg()
            if self.heldout_avg_before is not None:
                e = cfg.eval
                console.say(
                    f"held-out avg@{e.heldout_k} (temperature {e.temperature:g}) before training: "
                    f"{self.heldout_avg_before['mean']:.3f}"
                )
        show = self.is_main and cfg.progress_bar
        done, total = self._progress()
        bar = console.progress_bar(total, "train", enabled=show, initial=done)
        try:
            with StopSignals() as stop:
                while not self._finished():
                    step_log = self.train_step()
                    self._finish_step(step_log, stop_requested=dist.all_max(stop.received is not None) == 1)
                    bar.set_postfix(metrics.progress_fields(step_log, self.last_selection), refresh=False)
                    now = self._progress()[0]
                    bar.update(now - done)
                    done = now
        finally:
            bar.close()
            self.loggers.close()
        after, avg_after = self.evaluator.heldout(), self.evaluator.heldout_avg()
        avg = avg_after and {
            "k": cfg.eval.heldout_k,
            "temperature": cfg.eval.temperature,
            "before": self.heldout_avg_before,
            "after": avg_after,
        }
        summary = metrics.run_summary(
            self.step,
            self.heldout_before,
            after,
            self.last_selection,
            self.best,
            temperature=cfg.rollout.eval_temperature,
            avg=avg,
            cpu_kernels=torch.backends.cpu.get_cpu_capability(),
        )
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _finished(self, step: int | None = None, cursor: sampling.Cursor | None = None) -> bool:
        """max_steps steps done, or without max_steps `epochs` epochs (refills make them fewer steps); at the
        trainer's step and cursor, or at those of a round asked for ahead."""
        step, cursor = self.step if step is None else step, cursor or self.cursor
        return step >= self.cfg.max_steps if self.cfg.max_steps else cursor.epoch >= self.cfg.epochs

    def _progress(self) -> tuple[int, int]:
        """(done, total) for the progress bar: steps under max_steps, else batches of the epochs consumed."""
        if self.cfg.max_steps:
            return self.step, self.cfg.max_steps
        return self.cursor.epoch * self.steps_per_epoch + self.cursor.batch, self.total_steps

    def _finish_step(self, step_log: dict, stop_requested: bool) -> None:
        """Validate, checkpoint and log one finished step; stop on a signal (every rank agreed) or bad steps."""
        cfg = self.cfg
        last = self._finished()
        save = (cfg.save_steps and self.step % cfg.save_steps == 0) or last
        # a step trained on samples of an engine that drifted from the policy is never checkpointed
        # (only rounds of the trainer's own weights: a stale round's drift is policy change, not a sync fault)
        fresh = not step_log.get(prefetch.STALENESS)
        savable, unhealthy = self.health.check(self.step, step_log[METRIC] if fresh else None, self._last_checkpoint)
        # a step with the rambling signature (truncation and entropy jumped together) is not checkpointed either
        entropy = step_log["entropy"] if step_log["trained_sequences"] else None
        calm, rambling = self.rambling.check(self.step, step_log["truncated_frac"], entropy, self._last_checkpoint)
        savable, unhealthy = savable and calm, unhealthy or rambling
        if cfg.eval.steps and (self.step % cfg.eval.steps == 0 or last):
            step_log["eval"] = self.evaluator.validation()
            score = step_log["eval"][cfg.eval.select_on or "mean"]
            if savable and (self.best is None or score > self.best["score"]):
                self.best = {"step": self.step, "score": score}
                save = True  # the best checkpoint must exist
        saved = None
        if (save or stop_requested) and savable:
            started = time.perf_counter()
            saved = self.save()
            step_log["timing"]["save"] = round(time.perf_counter() - started, 4)
        if self.is_main:
            metrics.append_jsonl(self.run_dir / "metrics.jsonl", step_log)
            self.loggers.log_step(step_log)
        for kind, message in metrics.step_warnings(step_log):
            console.warn_once(kind, message)
        if unhealthy:
            raise TrainingError(unhealthy)
        if stop_requested:
            raise Preempted(
                f"stopped by a signal after step {self.step}; checkpoint {saved or self._last_checkpoint()}; "
                "run again with resume_from=latest to continue"
            )
        self._count_bad_steps(step_log["skipped"])

    def _count_bad_steps(self, skipped: bool) -> None:
        """A skipped (non-finite) update is logged; train.max_bad_steps of them in a row stop the run."""
        if not skipped:
            self.bad_steps = 0
            return
        self.bad_steps += 1
        console.say(f"step {self.step}: non-finite loss, update skipped ({self.bad_steps} in a row)")
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingError(
                f"stopping: {self.bad_steps} consecutive steps with a non-finite loss (last at step "
                f"{self.step}); last good checkpoint: {self._last_checkpoint() or 'none'}"
            )

    def close(self) -> None:
        self.verifier.close()
        self._close_engine()  # rollout.placement separate: the rollout ranks stop with the trainer


def run(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if trainer.is_main:
        print(metrics.summary_text(summary), file=console.terminal_out(), flush=True)
    return summary
