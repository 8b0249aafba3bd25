"""The TraPO / GRPO training loop: DeepSpeed ZeRO-3 policy, rollouts, pass-rate gate.

One step, on every rank (each rank takes every world_size-th question of the batch):
    1. rollouts   G samples per question from the `RolloutSource` (trapo/training/rollout_source.py): the rank's
                  own engine (rollout.backend: vLLM, or the policy), or with rollout.placement separate the
                  rollout ranks', asked ahead
    2. grading    Math-Verify vs gold (labeled), majority vote (unlabeled)
    3. pass rates gathered from all ranks into the replicated PassRateTracker;
                  the gate M comes from the selection made at the last epoch end;
                  with rollout.dynamic_sampling, groups with equal rewards leave the
                  step and 1-3 repeat on the epoch's next batches (trapo/training/sampling.py)
    4. update     Dr.GRPO advantages, L = J_labeled + M * J_unlabeled, token-budget
                  micro-batches, one DeepSpeed optimizer step per update batch
    5. push       the new weights, gathered block by block, into vLLM (the hf backend is the policy: no push)
    6. log        statistics summed over ranks
    7. cursor     the data cursor moves on; at an epoch's end the tracker appends the epoch's pass rates
                  to every trajectory and selects the reliable unlabeled questions for the next epoch
The components do the work: `Policy` (trapo/engine/policy.py), the `RolloutSource`, `grade`
(trapo/training/grading.py), `update_policy` (trapo/training/update.py), the `RunState`
(trapo/training/run_state.py: the step, the cursor, the `PassRateTracker` and all else a checkpoint holds),
`trapo.training.metrics` and the `Loggers`.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from trapo import console, hub, runtime
from trapo.algorithm.rewards.verifiers import require_verifier
from trapo.algorithm.selection import confidence_kind
from trapo.config import Config, dump_config, to_dict
from trapo.engine import checkpoint as ckpt
from trapo.engine import dist, static_decoding
from trapo.engine.grading.verifier import MathVerifier
from trapo.engine.packing import update_efficiency
from trapo.engine.policy import TrainingError
from trapo.engine.rollout import Rollout, require_backend
from trapo.training import curriculum, metrics, prefetch, rollout_dump, run_record, sampling
from trapo.training.evaluation import Evaluator
from trapo.training.grading import Grades, confidence_kinds, confidence_scores, grade, label_votes, unlabeled_reward
from trapo.training.health import METRIC, RolloutHealth
from trapo.training.inputs import fetch_model, prepare_inputs
from trapo.training.loggers import Loggers
from trapo.training.preemption import Preempted, StopSignals
from trapo.training.rollout_source import open_rollout_source
from trapo.training.run_state import RunState
from trapo.training.settings import open_policy, planned
from trapo.training.update import UpdateResult, update_policy


class Trainer:
    """One run's loop over its parts: the `Policy`, the `RolloutSource` (colocated or separate, decided where it
    is built), the grader, the `Evaluator`, the `RunState` (what a checkpoint holds) and the loggers."""

    def __init__(self, cfg: Config):
        # auto: vLLM or hf, chosen here (a resume: the engine it started with); config.yaml records the choice
        self.chosen: list[str] = []  # the lines of what start-up chose, said with the run's first lines (train)
        cfg = run_record.resolve_backend(cfg, say=self.chosen.append)
        self.cfg = cfg
        require_backend(cfg.rollout.backend, load=False)  # vLLM missing: one line before any work
        require_verifier(cfg.reward.verifier)  # reward.verifier that cannot be imported: the same
        if cfg.rollout.backend == "hf":  # a captured decode path on a machine without CUDA: the same
            static_decoding.require_device(cfg.rollout.hf_decoding, "cuda" if torch.cuda.is_available() else "cpu")
        self.rank, self.world, self.local_rank = dist.init_distributed(cfg.dist_timeout_minutes)
        self.is_main = self.rank == 0
        self.run_dir = cfg.run_dir
        for notice in runtime.NOTICES:  # what the environment set-up changed, e.g. TORCHDYNAMO_DISABLE on GPU
            console.say(notice)
        self.model_source, self.changes = self._claim_run_dir()
        inputs = prepare_inputs(cfg, self.world, self.model_source and str(self.model_source.local_dir))
        self.model_dir, self.tokenizer = inputs.model_dir, inputs.tokenizer
        self.questions, self.prompts = inputs.questions, inputs.prompts
        # A vLLM that fails to import: one line after the input checks (they stay quick), before the model loads
        require_backend(cfg.rollout.backend)
        # the memory plan's choices on this node for the auto settings the policy and engine run, said with the rest
        run = planned(cfg, self.model_dir, self.world, say=self.chosen.append)
        self.policy = open_policy(run, self.model_dir, self.world, self.tokenizer.pad_token_id)
        # rollout.placement, decided here once: this rank's own engine, or the rollout ranks' behind a link
        self.rollouts = open_rollout_source(run, self.policy, inputs, rank=self.rank, world=self.world)
        self.verifier = MathVerifier(
            num_workers=cfg.reward.workers, timeout=cfg.reward.timeout, spec=cfg.reward.verifier
        )
        self.evaluator = Evaluator(
            cfg,
            self.rollouts.engine,
            self.policy,
            self.tokenizer,
            self.verifier,
            rank=self.rank,
            world=self.world,
            turn=self.rollouts.turn,
            test=inputs.test_benchmarks,
            validation=inputs.val_benchmarks,
        )
        self.unlabeled_reward = unlabeled_reward(cfg)  # reward.unlabeled, built once
        self.state = RunState(
            cfg,
            torch.tensor([q.labeled for q in self.questions]),
            torch.tensor([q.answer is not None for q in self.questions]),  # labels.*: the golds held back
            rank=self.rank,
            world=self.world,
            steps_per_epoch=inputs.steps_per_epoch,
            total_steps=inputs.total_steps,
            policy=self.policy,
            tokenizer=self.tokenizer,
            verifier=self.verifier,
            rollouts=self.rollouts,
            model_commit=self.model_source and self.model_source.commit,
        )
        self.health = RolloutHealth(cfg.rollout.health)  # stops a run whose engine drifts from the policy
        self.loggers = Loggers([])  # TensorBoard, wandb, MLflow (logging.*), opened on rank 0 by train()
        # the checkpoint this start resumed, if any, and its world size when it differs from this run's
        self.resumed_from, self.moved_from = self.state.resume()
        self._labeled_now(self.state.tracker.bought.nonzero().squeeze(1).tolist())  # labels bought before a resume

    def _claim_run_dir(self) -> tuple[hub.Snapshot | None, dict]:
        """Rank 0 owns the run directory (one run at a time) before it looks at or cleans anything in it; then
        the model is fetched (a hub id: once per node) and a resume's settings are held against its record:
        (the model's snapshot, or None for a local directory; the changed settings resume_changes allows)."""
        cfg, ckpt_root = self.cfg, self.run_dir / "checkpoints"
        dist.on_rank0(lambda: run_record.open_run_dir(self.run_dir, ckpt_root, cfg.resume_from))
        resumes = ckpt.resolve(cfg.resume_from, ckpt_root)  # a missing resume_from: now
        model_source = fetch_model(cfg)
        # a resume keeps its record: a changed setting that would alter the run stops it before any load
        settings = to_dict(run_record.as_run(cfg, model_source))
        changes = run_record.resume_changes(self.run_dir, settings, cfg.resume_changes, resumes) if resumes else {}
        return model_source, changes

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict:
        state, timer, started = self.state, metrics.StepTimer(), time.perf_counter()
        epoch, first = state.cursor.epoch, state.cursor.batch
        self.rollouts.send_ahead(state)  # rollout.placement separate: this step's round, and the next max_staleness
        # sampling.curriculum: the epoch's batches without the questions it skips (the tracker's plan)
        order, skips = curriculum.epoch_order(self.cfg, state.tracker, epoch)

        # 1-3. rollouts, grading, pass rates into the tracker and rewards, one round per batch: one batch,
        #      with rollout.dynamic_sampling more of the epoch's until enough groups carry a signal
        rounds, informative, kept = self._rollout_rounds(order, first, timer)
        self.rollouts.send_ahead(state, used=len(rounds))  # dynamic sampling: the next step's first round, now known
        plan, n_updates = sampling.update_plan(kept, self.rank, self.world, self.cfg.train.update_batch_size)
        self._dump_rollouts(rounds, plan)  # logging.rollouts_every: what was generated and how it was scored

        # 4. advantages and the update(s) on the kept groups
        with timer.time("update"), runtime.intra_op_threads(self.cfg.train.update_threads):
            coef = state.entropy_control and state.entropy_control.coef  # None: the LossSpec's fixed coefficient
            update = self._update(rounds, plan, n_updates, entropy_coef=coef)

        # 5. the weights into the engine (also after a skipped update: a sleeping vLLM released its copy)
        with timer.time("weight_push"):
            pushed_bytes = self.rollouts.push_weights()

        # 6. statistics over all ranks
        totals = dist.all_sum({**update.sums, **self._rollout_sums(rounds, plan)})
        step_log = self._step_values(epoch, totals, update, n_updates, pushed_bytes)
        if state.entropy_control is not None:  # the coefficient this step trained with; then the next step's
            step_log["entropy_coef"] = coef
            state.entropy_control.update(step_log["entropy"] if totals["trained_tokens"] else None)
        if self.cfg.rollout.dynamic_sampling:
            rolled = sum(len(order[first + i]) for i in range(len(rounds)))
            step_log["dynamic_sampling"] = metrics.dynamic_sampling_values(rolled, informative, len(kept), len(rounds))
        if skips is not None:
            step_log["curriculum"] = curriculum.step_values(skips, order, state.tracker.labeled)

        # 7. the data cursor moves on; at the epoch's end, extend trajectories and select for the next epoch
        state.cursor = state.cursor.advance(len(rounds), len(order))
        if state.cursor.epoch > epoch:  # the epoch's batches are used up
            step_log["selection"] = self._end_epoch()
            if skips is not None:  # what the epoch's re-admitted questions showed
                step_log["curriculum"].update(curriculum.epoch_end_values(self.cfg, state.tracker))
        state.step += 1
        timer.seconds["step"] = time.perf_counter() - started
        moved = self.policy.moved if self.policy.offload_states else None  # what went to host memory, and the time
        return step_log | metrics.cost_values(timer, totals["response_tokens"], moved)

    def _step_values(self, epoch: int, totals: dict, update: UpdateResult, n_updates: int, pushed_bytes: int) -> dict:
        """The step's metrics.jsonl row from the statistics summed over all ranks (the blocks of optional
        features and the costs come after)."""
        unlabeled = self.cfg.mode != "supervised"
        return {
            "step": self.state.step + 1,
            "epoch": epoch + 1,
            **metrics.step_values(
                totals, world=self.world, updates=n_updates, applied=update.applied, unlabeled=unlabeled
            ),
            "selected_unlabeled": int(self.state.tracker.selected.sum()),  # the gate's current open set
            "pushed_gb": pushed_bytes / 2**30,
            # groups rolled out whose G rewards are all equal (advantage 0), before any dynamic-sampling filter
            "zero_advantage_frac": totals["zero_advantage_groups"] / max(totals["groups"], 1),
            **self.rollouts.staleness(self.state.step, totals),  # separate: how many updates the rollouts lag
            **update_efficiency(update.work),  # signal tokens / tokens computed by all ranks, and the rest's parts
        }

    def _update(self, rounds: list[sampling.Round], plan: dict, n_updates: int, entropy_coef: float | None):
        """Advantages and the optimizer steps on this rank's groups that the step keeps (`update_policy`)."""
        groups = sampling.take(rounds, plan, self.rank, self.world)
        prompts = [self.prompts[i] for i in groups.question_ids]
        labeled = [self.questions[i].labeled for i in groups.question_ids]
        first = rounds[0]  # this rank's answers of the step's first round: the engine's health when none trains
        answers = ([self.prompts[i] for i in first.question_ids], first.rollouts)
        return update_policy(
            self.policy,
            self.cfg,
            groups,
            prompts,
            labeled,
            step=self.state.step,
            n_updates=n_updates,
            entropy_coef=entropy_coef,
            answers=answers,
        )

    def _rollout_rounds(self, order: list[list[int]], first: int, timer: metrics.StepTimer) -> tuple[list, int, list]:
        """Roll out batch `first` of the epoch's `order`, and with dynamic sampling the next ones while too few
        groups over all ranks have unequal rewards. Returns (this rank's rounds, informative groups over all
        ranks, the kept groups' keys: all of one batch, or the informative ones cut to the batch size)."""
        r, target = self.cfg.rollout, self.cfg.train.rollout_batch_size
        rounds, keys = [], []
        while True:
            if rounds and self.rollouts.weights_asleep:  # GPU: the last round's engine turn released them
                with timer.time("weight_push"):
                    self.rollouts.push_weights()
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
            rollouts = self.rollouts.generate(self.state.step, question_ids)  # [b][G]
        # 2. grading: rewards and (pseudo) pass rates; the confidence scores the selection strategy or the
        # unlabeled reward read are a policy forward over the unlabeled responses (collective), timed as grading
        with timer.time("grading"):
            scored = self._confidence_scores(question_ids, rollouts)  # {kind: {position: [G] scores}}
            grades = grade(
                questions,
                [[r.text for r in group] for group in rollouts],
                cfg.reward.timeout,
                self.verifier,
                budget=cfg.reward.step_budget,
                unlabeled=self.unlabeled_reward,
                scores=scored.get(self.unlabeled_reward.score_kind, {}),
                vote_labeled=self.state.labels.calibrates,
            )
        # 3. pass rates from every rank into the tracker; the gate for this epoch was fixed at the last epoch end
        with timer.time("grading"):
            gate = self._record_pass_rates(question_ids, grades, scored)  # [b]
            if self.state.labels.active:  # labels.*: every rank's votes, which the epoch end's label score reads
                for rows in dist.all_gather(label_votes(question_ids, questions, grades)):
                    for row in rows:
                        self.state.labels.record(*row)
        return sampling.Round(question_ids, rollouts, grades, gate, grades.rewards)

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
            self.state.step + 1,
            ids,
            [self.questions[q] for q in ids],
            prompts=[self.prompts[q] for q in ids],
            decode=self.tokenizer.decode,
            texts=[[r.text for r in group] for rnd in rounds for group in rnd.rollouts],
            rewards=[rewards for rnd in rounds for rewards in rnd.rewards],
            grades=Grades.concat([rnd.grades for rnd in rounds]),
            gate=[m for gate in sampling.in_loss(rounds, plan, self.rank, self.world) for m in gate],
        )

    def _end_epoch(self) -> dict:
        """Extend every trajectory with the epoch's pass rates, select for the next epoch, dump the selection;
        buy the epoch's gold labels (labels.*) unless it is the run's last."""
        state = self.state
        state.last_selection = state.tracker.end_epoch()
        if self.is_main and state.last_selection["tcs_selected"] is not None:
            path = self.run_dir / "selection.jsonl"  # the first row also carries the warm-up's trajectories
            row = state.tracker.selection_row(history=not path.is_file())
            metrics.append_jsonl(path, row)
            self.loggers.log_selection(row, step=state.step + 1)  # the step that closes the epoch
        bought = None if state.finished(state.step + 1) else state.labels.buy(state.tracker)
        if bought is not None:  # alike on every rank: the questions are labeled from the next step on
            self._labeled_now(bought["question"])
            if self.is_main:  # the step that closed the epoch first: a resume trims the rows after its checkpoint
                metrics.append_jsonl(self.run_dir / "labels.jsonl", {"step": state.step + 1} | bought)
            state.last_selection = state.last_selection | {"bought": len(bought["question"]), "spent": bought["spent"]}
        return state.last_selection

    def _labeled_now(self, question_ids: list[int]) -> None:
        """Questions whose gold was bought (labels.*): graded and trained as labeled from here on."""
        for i in question_ids:
            self.questions[i] = dataclasses.replace(self.questions[i], labeled=True)

    def _confidence_scores(self, question_ids: list[int], rollouts: list[list[Rollout]]) -> dict[str, dict]:
        """{kind: {position in the batch: its G confidence scores}} of this rank's unlabeled questions, for the
        kinds the selection strategy and the unlabeled reward need (`grading.confidence_kinds`). Collective."""
        unlabeled = [pos for pos, i in enumerate(question_ids) if not self.questions[i].labeled]
        return confidence_scores(
            self.policy,
            confidence_kinds(self.cfg, self.state.tracker.labeled),
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
        self.state.tracker.record(
            torch.tensor([i for ids, *_ in gathered for i in ids]),
            torch.tensor([p for _, rates, *_ in gathered for p in rates]),
            torch.tensor([c for _, _, correct, _ in gathered for c in correct]),
            torch.tensor([c for *_, conf in gathered for c in conf]),
        )
        if self.cfg.mode != "trapo":
            return [1.0] * len(question_ids)
        return self.state.tracker.gate(torch.tensor(question_ids)).tolist()

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        self._start()
        state = self.state
        done, total = state.progress()
        bar = console.progress_bar(total, "train", enabled=self.is_main and self.cfg.progress_bar, initial=done)
        try:
            with StopSignals() as stop:
                while not state.finished():
                    step_log = self.train_step()
                    self._finish_step(step_log, stop_requested=dist.all_max(stop.received is not None) == 1)
                    bar.set_postfix(metrics.progress_fields(step_log, state.last_selection), refresh=False)
                    now = state.progress()[0]
                    bar.update(now - done)
                    done = now
        finally:
            bar.close()
            self.loggers.close()
        return self._summary()

    def _start(self) -> None:
        """The start recorded (starts.jsonl), the loggers opened, the run's first lines, and on a fresh start
        the held-out scores before training."""
        cfg, state = self.cfg, self.state
        if self.is_main:  # the first start's config stays; every start is a line of starts.jsonl
            start = {
                "step": state.step,
                "world": self.world,
                "resumed_from": self.resumed_from,
                "moved_from_world": self.moved_from,
                "changes": self.changes,
            }
            run_record.record_start(self.run_dir, dump_config(run_record.as_run(cfg, self.model_source)), start)
        # every rank: a missing package, or a backend rank 0 cannot start, stops all ranks now, before any step
        self.loggers = Loggers.open_everywhere(cfg, self.is_main, state.tracker_ids)
        state.tracker_ids = self.loggers.ids() or state.tracker_ids  # what the checkpoints keep from now on
        for line in self.chosen:
            console.say(line)
        n_labeled = sum(q.labeled for q in self.questions)
        refills = " at most (dynamic sampling: refills consume batches)" if cfg.rollout.dynamic_sampling else ""
        if cfg.sampling.curriculum != "none":  # skipped questions shorten epochs too
            refills = " at most (sampling.curriculum: skipped questions shorten epochs)"
        console.say(
            f"mode {cfg.mode}: {n_labeled} labeled + {len(self.questions) - n_labeled} unlabeled questions, "
            f"{state.steps_per_epoch} steps per epoch, {state.total_steps} steps{refills}, world size {self.world}"
        )
        if state.step == 0:
            state.heldout_before = self.evaluator.heldout()
            if state.heldout_before is not None:
                console.say(f"held-out accuracy before training: {state.heldout_before['mean']:.3f}")
            state.heldout_avg_before = self.evaluator.heldout_avg()
            if state.heldout_avg_before is not None:
                e = cfg.eval
                console.say(
                    f"held-out avg@{e.heldout_k} (temperature {e.temperature:g}) before training: "
                    f"{state.heldout_avg_before['mean']:.3f}"
                )

    def _summary(self) -> dict:
        """The held-out scores after training beside those before; summary.json (rank 0)."""
        cfg, state = self.cfg, self.state
        after, avg_after = self.evaluator.heldout(), self.evaluator.heldout_avg()
        avg = avg_after and {
            "k": cfg.eval.heldout_k,
            "temperature": cfg.eval.temperature,
            "before": state.heldout_avg_before,
            "after": avg_after,
        }
        summary = metrics.run_summary(
            state.step,
            state.heldout_before,
            after,
            state.last_selection,
            state.best,
            temperature=cfg.rollout.eval_temperature,
            avg=avg,
            cpu_kernels=torch.backends.cpu.get_cpu_capability(),
        )
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _finish_step(self, step_log: dict, stop_requested: bool) -> None:
        """Validate, checkpoint and log one finished step; stop on a signal (every rank agreed) or bad steps."""
        cfg, state = self.cfg, self.state
        last = state.finished()
        save = (cfg.save_steps and state.step % cfg.save_steps == 0) or last
        # a step trained on samples of an engine that drifted from the policy is never checkpointed
        # (only rounds of the trainer's own weights: a stale round's drift is policy change, not a sync fault)
        fresh = not step_log.get(prefetch.STALENESS)
        savable, unhealthy = self.health.check(state.step, step_log[METRIC], state.last_checkpoint, stale=not fresh)
        # a step with the rambling signature (truncation and entropy jumped together) is not checkpointed either
        entropy = step_log["entropy"] if step_log["trained_sequences"] else None
        calm, rambling = state.rambling.check(state.step, step_log["truncated_frac"], entropy, state.last_checkpoint)
        savable, unhealthy = savable and calm, unhealthy or rambling
        if cfg.eval.steps and (state.step % cfg.eval.steps == 0 or last):
            step_log["eval"] = self.evaluator.validation()
            score = step_log["eval"][cfg.eval.select_on or "mean"]
            if savable and (state.best is None or score > state.best["score"]):
                state.best = {"step": state.step, "score": score}
                save = True  # the best checkpoint must exist
        saved = None
        if (save or stop_requested) and savable:
            started = time.perf_counter()
            saved = state.save()
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
                f"stopped by a signal after step {state.step}; checkpoint {saved or state.last_checkpoint()}; "
                "run again with resume_from=latest to continue"
            )
        self._count_bad_steps(step_log["skipped"])

    def _count_bad_steps(self, skipped: bool) -> None:
        """A skipped (non-finite) update is logged; train.max_bad_steps of them in a row stop the run."""
        state = self.state
        if not skipped:
            state.bad_steps = 0
            return
        state.bad_steps += 1
        console.say(f"step {state.step}: non-finite loss, update skipped ({state.bad_steps} in a row)")
        if state.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingError(
                f"stopping: {state.bad_steps} consecutive steps with a non-finite loss (last at step "
                f"{state.step}); last good checkpoint: {state.last_checkpoint() or 'none'}"
            )

    def close(self) -> None:
        self.verifier.close()
        self.rollouts.close()  # rollout.placement separate: the rollout ranks stop with the trainer


def run(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if trainer.is_main:
        print(metrics.summary_text(summary), file=console.terminal_out(), flush=True)
    return summary
