"""The TraPO / GRPO training loop: DeepSpeed ZeRO-3 policy, colocated vLLM rollouts, pass-rate gate.

One step, on every rank (each rank takes every world_size-th question of the batch):
    1. rollouts   G samples per question from the rank's own vLLM engine
    2. grading    Math-Verify vs gold (labeled), majority vote (unlabeled)
    3. pass rates gathered from all ranks into the replicated PassRateTracker;
                  the gate M comes from the selection made at the last epoch end
    4. update     Dr.GRPO advantages, L = J_labeled + M * J_unlabeled, token-budget
                  micro-batches, one DeepSpeed optimizer step per update batch
    5. push       the new weights, gathered module by module, into vLLM
    6. log / checkpoint
At an epoch's end the tracker appends the epoch's pass rates to every
trajectory and selects the reliable unlabeled questions for the next epoch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trapo import checkpoint as ckpt
from trapo.batch import TrainSequence, collate, loss_denominator, pack_by_tokens
from trapo.config import Config, dump_config
from trapo.data import DataError, Question, epoch_batches, load_questions, select_for_mode, tokenize_prompts
from trapo.eval import Benchmark, avg_at_k, evaluate, read_benchmark_file
from trapo.grading import grade
from trapo.logits import token_entropy, token_logprobs
from trapo.loss import group_advantages, policy_loss
from trapo.passrate import PassRateTracker, SelectionConfig
from trapo.rewards.verifier import MathVerifier
from trapo.rollout import RolloutEngine


class TrainingError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- distributed helpers


def init_distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank). Plain `python` gets a one-process world."""
    import deepspeed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        # DeepSpeed would JIT-compile a shared-memory op (about a minute) that gloo does not need.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def all_gather(obj):
    """Every rank's `obj`, in rank order (small Python objects only)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rollout_seed(seed: int, step: int, question: int) -> int:
    """Per-request vLLM seed: a function of (run seed, step, question) only, so a resumed run resamples identically."""
    digest = hashlib.blake2b(f"{seed}/{step}/{question}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# ----------------------------------------------------------------------------- the trainer


@dataclass
class StepLog:
    values: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    @contextmanager
    def time(self, name: str):
        start = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world, self.local_rank = init_distributed()
        self.is_main = self.rank == 0
        self.device = _comm_device()
        self.run_dir = cfg.run_dir
        self.ckpt_root = self.run_dir / "checkpoints"
        self._prepare_inputs()  # data and prompts checked before any model loads
        self._build_policy()
        self._build_rollout_engine()
        self.verifier = MathVerifier(num_workers=cfg.reward.workers, timeout=cfg.reward.timeout)
        sel = cfg.selection
        self.tracker = PassRateTracker(
            torch.tensor([q.labeled for q in self.questions]),
            SelectionConfig(
                sel.warmup_epochs, sel.top_p, sel.threshold, sel.reference, sel.standardize, sel.random, cfg.seed
            ),
        )
        self.step = 0
        self.bad_steps = 0
        self.last_selection: dict | None = None
        self.best: dict | None = None  # {"step", "score"} of the best validation score so far
        self._resume()

    # ------------------------------------------------------------------ set-up

    def log(self, msg: str) -> None:
        if self.is_main:
            print(f"[trapo] {msg}", file=sys.stderr, flush=True)

    def _prepare_inputs(self) -> None:
        cfg = self.cfg
        if cfg.toy.enabled:
            from trapo.toy import asset_dir, build_assets

            if self.is_main:
                build_assets(cfg.toy, log=self.log)
            dist.barrier()
            root = asset_dir(cfg.toy)
            self.model_dir = str(root / "model")
            train_files = [str(root / "train.jsonl")]
            test_files = [str(p) for p in (root / "test.jsonl", root / "test_ood.jsonl") if p.is_file()]
        else:
            self.model_dir = cfg.model.path
            train_files, test_files = cfg.data.train_files, cfg.data.test_files
            if not (Path(self.model_dir) / "config.json").is_file():
                raise DataError(f"model.path {self.model_dir}: not a Hugging Face model directory (no config.json)")
        if cfg.train.rollout_batch_size % self.world or cfg.train.update_batch_size % self.world:
            raise DataError(
                f"train.rollout_batch_size ({cfg.train.rollout_batch_size}) and train.update_batch_size "
                f"({cfg.train.update_batch_size}) must be multiples of the world size ({self.world})"
            )
        self.questions: list[Question] = select_for_mode(
            load_questions(train_files, cfg.data.labeled_ratio, cfg.seed), cfg.mode
        )
        self.test_benchmarks = [b for f in test_files for b in read_benchmark_file(Path(f))]
        val_files = cfg.eval.files or (test_files if cfg.toy.enabled else [])  # the toy validates on its test splits
        self.val_benchmarks = [b for f in val_files for b in read_benchmark_file(Path(f))]
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        t = cfg.data
        self.prompts = tokenize_prompts(self.questions, t.prompt_template, self.tokenizer, t.max_prompt_tokens)
        for bench in self.test_benchmarks + self.val_benchmarks:  # prompt lengths checked now, not mid-run
            tokenize_prompts(bench.questions, t.prompt_template, self.tokenizer, t.max_prompt_tokens)
        self.steps_per_epoch = len(epoch_batches(len(self.questions), cfg.train.rollout_batch_size, self.world, 0, 0))
        if self.steps_per_epoch == 0:
            raise DataError(f"{len(self.questions)} training questions: too few for one batch on {self.world} ranks")
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch

    def _dtype(self) -> torch.dtype:
        name = self.cfg.model.dtype
        if name == "auto":
            name = "bfloat16" if torch.cuda.is_available() else "float32"
        return getattr(torch, name)

    def _build_policy(self) -> None:
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        cfg = self.cfg
        try:
            ds_config = json.loads(Path(cfg.train.deepspeed_config).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise DataError(f"train.deepspeed_config {cfg.train.deepspeed_config}: cannot read JSON ({err})") from None
        # We micro-batch by tokens ourselves and call step() once per update batch:
        # unmanaged gradient accumulation makes step() the boundary however many backward() calls came first.
        ds_config.update(
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            train_batch_size=self.world,
            managed_gradient_accumulation=False,
            zero_allow_untested_optimizer=True,
        )
        ds_config["bf16"] = {"enabled": self._dtype() == torch.bfloat16}
        ds_config.pop("fp16", None)
        self.ds_config = ds_config
        self._hf_ds = HfDeepSpeedConfig(ds_config)  # must outlive from_pretrained: it turns on zero.Init

        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.hf_overrides = {}
        if cfg.model.rope_theta is not None:
            self.hf_overrides["rope_theta"] = cfg.model.rope_theta
        if cfg.model.max_position_embeddings is not None:
            self.hf_overrides["max_position_embeddings"] = cfg.model.max_position_embeddings
        for key, value in self.hf_overrides.items():
            setattr(hf_config, key, value)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, config=hf_config, dtype=self._dtype())
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        t = cfg.train
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay
        )
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.model = self.engine.module

    def _build_rollout_engine(self) -> None:
        r, d = self.cfg.rollout, self.cfg.data
        self.rollout = RolloutEngine(
            self.model_dir,
            dtype=str(self._dtype()).replace("torch.", ""),
            max_model_len=d.max_prompt_tokens + r.max_tokens,
            seed=self.cfg.seed + self.rank,
            gpu_memory_utilization=r.gpu_memory_utilization,
            cpu_kv_cache_gb=r.cpu_kv_cache_gb,
            enable_sleep_mode=r.enable_sleep_mode,
            enable_prefix_caching=r.enable_prefix_caching,
            hf_overrides=self.hf_overrides,
        )

    # ------------------------------------------------------------------ weights

    def full_weights(self):
        """(Hugging Face name, full tensor) for every parameter, gathered one block at a time.

        A block is a repeated layer (`model.layers.N`) or, outside the layer stack, one
        module: one collective gather per block keeps the peak extra memory at one
        layer while making far fewer calls than gathering module by module.
        """
        import deepspeed

        for params in _blocks(self.model.named_parameters()):
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                for name, p in params:
                    # A copy: the gathered buffer is freed when the context exits,
                    # and vLLM may keep a tensor until its fused partner arrives.
                    yield name, p.data.detach().clone()

    def push_weights(self) -> tuple[int, float]:
        return self.rollout.push_weights(self.full_weights())

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        tmp = ckpt.staging_dir(self.ckpt_root, self.step)
        if self.is_main:
            ckpt.begin(self.ckpt_root, self.step)
        dist.barrier()
        self.engine.save_checkpoint(str(tmp), tag="ds", save_latest=False)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            },
            tmp / "rng" / f"rank-{self.rank}.pt",
        )
        state = {}
        for name, tensor in self.full_weights():  # collective: every rank gathers, rank 0 keeps
            if self.is_main:
                state[name] = tensor.cpu().contiguous()
        if self.is_main:
            from safetensors.torch import save_file

            hf = tmp / "hf"
            hf.mkdir()
            save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(hf)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(hf)
            self.tokenizer.save_pretrained(hf)
            torch.save(
                {
                    "step": self.step,
                    "tracker": self.tracker.state_dict(),
                    "bad_steps": self.bad_steps,
                    "last_selection": self.last_selection,
                    "best": self.best,
                    "world_size": self.world,
                },
                tmp / "trainer_state.pt",
            )
        dist.barrier()
        final = ckpt.final_dir(self.ckpt_root, self.step)
        if self.is_main:
            _commit(self.ckpt_root, self.step)
            best = None
            if self.best is not None:
                best = self.best["step"]
                info = {**self.best, "checkpoint": str(ckpt.final_dir(self.ckpt_root, best))}
                (self.run_dir / "best.json").write_text(json.dumps(info, indent=2))
            ckpt.prune(self.ckpt_root, self.cfg.keep_checkpoints, protect=best)
        dist.barrier()
        return final

    def _resume(self) -> None:
        path = ckpt.resolve(self.cfg.resume_from, self.ckpt_root)
        if path is None:
            if self.cfg.resume_from == "latest":
                self.log(f"resume_from: latest: no checkpoint under {self.ckpt_root} yet, starting fresh")
            return
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if state["world_size"] != self.world:
            raise TrainingError(
                f"{path}: saved with {state['world_size']} ranks, resuming with {self.world}; "
                "the batch order depends on the world size, so resume with the same number of ranks"
            )
        load_path, _ = self.engine.load_checkpoint(str(path), tag="ds")
        if load_path is None:
            raise TrainingError(f"{path}/ds: DeepSpeed could not load the checkpoint")
        self.tracker.load_state_dict(state["tracker"])
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        self.last_selection = state["last_selection"]
        self.best = state["best"]
        rng = torch.load(path / "rng" / f"rank-{self.rank}.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"])
        self.push_weights()
        if self.is_main:
            _trim_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.log(f"resumed from {path} at step {self.step}")

    # ------------------------------------------------------------------ forward passes

    def _microbatches(self, seqs: list[TrainSequence]):
        """Yield (indices into seqs, collated batch) per token-budget micro-batch.

        Ranks with fewer micro-batches add empty ones (indices [], a 2-token dummy
        batch): every rank must run the same number of forward/backward passes,
        because ZeRO-3 gathers parameters collectively.
        """
        groups = pack_by_tokens([len(s.ids) for s in seqs], self.cfg.train.micro_batch_tokens)
        groups += [[] for _ in range(all_max(len(groups)) - len(groups))]
        pad = self.tokenizer.pad_token_id
        for group in groups:
            if group:
                yield group, collate([seqs[i] for i in group], pad)
            else:
                yield group, collate([TrainSequence([pad, pad], 1, 0.0, 0.0, True)], pad)

    def _forward(self, batch: dict) -> torch.Tensor:
        out = self.engine(
            input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)
        )
        return out.logits[:, :-1].float()  # [b, T-1, V]: position t predicts token t+1

    @torch.no_grad()
    def _score_sequences(self, seqs: list[TrainSequence], kind: str) -> list[float]:
        """Confidence rewards from the current policy (no gradient), one per sequence."""
        from trapo.rewards import self_certainty_reward, sentence_likelihood_reward, token_entropy_reward

        scores = [0.0] * len(seqs)
        for group, batch in self._microbatches(seqs):
            logits = self._forward(batch)
            mask = batch["response_mask"].to(logits.device)
            if kind == "self_certainty":
                values = self_certainty_reward(logits, mask)
            elif kind == "token_entropy":
                values = token_entropy_reward(logits, mask)
            else:
                values = sentence_likelihood_reward(
                    token_logprobs(logits, batch["input_ids"][:, 1:].to(logits.device)), mask
                )
            for i, v in zip(group, values.tolist()):
                scores[i] = v
        return scores

    @torch.no_grad()
    def _store_old_logprobs(self, seqs: list[TrainSequence]) -> None:
        for group, batch in self._microbatches(seqs):
            logits = self._forward(batch)
            lp = token_logprobs(logits, batch["input_ids"][:, 1:].to(logits.device)).cpu()  # [b, T-1]
            for row, i in enumerate(group):
                s = seqs[i]
                s.old_logprobs = lp[row, s.prompt_len - 1 : len(s.ids) - 1].tolist()

    # ------------------------------------------------------------------ one step

    def _update(self, seqs: list[TrainSequence]) -> tuple[bool, dict]:
        """One optimizer step on this rank's sequences of an update batch.

        Returns (applied, this rank's sums of loss, pg_loss, token-weighted entropy
        and clip fraction, tokens, sequences trained); applied is False when a
        non-finite loss on any rank made the step be skipped.
        """
        cfg = self.cfg
        # Denominators over the whole update batch on all ranks (gated sequences included),
        # divided by the world size because DeepSpeed averages gradients over ranks.
        n_seq, n_tok = all_sum([len(seqs), sum(len(s.ids) - s.prompt_len for s in seqs)])
        denom = loss_denominator(cfg.loss.agg, int(n_seq), int(n_tok), cfg.rollout.max_tokens) / self.world
        active = [s for s in seqs if s.weight != 0.0]  # a gated-out sequence adds nothing: skip its compute
        finite = True
        sums = {"loss": 0.0, "pg_loss": 0.0, "entropy": 0.0, "clip_frac": 0.0, "tokens": 0.0}
        self.engine.train()
        for group, batch in self._microbatches(active):
            logits = self._forward(batch)  # [b, T-1, V]
            targets = batch["input_ids"][:, 1:].to(logits.device)  # [b, T-1]
            logprobs = token_logprobs(logits, targets)  # [b, T-1]
            mask = batch["response_mask"].to(logits.device)  # [b, T-1]
            entropy = token_entropy(logits) if cfg.loss.entropy_coef else None
            # One update per rollout batch (the paper's setting) is on-policy: pi_old = pi_theta.
            old = batch["old_logprobs"].to(logits.device) if "old_logprobs" in batch else logprobs.detach()
            loss, metrics = policy_loss(
                logprobs,
                old,
                batch["advantages"].to(logits.device),
                mask,
                clip_eps=cfg.loss.clip_eps,
                clip_eps_high=cfg.loss.clip_eps_high,
                weights=batch["weights"].to(logits.device),
                agg=cfg.loss.agg,
                denom=denom,
                entropy=entropy,
                entropy_coef=cfg.loss.entropy_coef,
            )
            if not group:
                loss = loss * 0.0
            finite &= bool(torch.isfinite(loss))
            # A non-finite loss still goes through backward: its NaN gradient makes DeepSpeed's
            # global gradient-norm check discard the whole step on every rank (no rank diverges).
            self.engine.backward(loss)
            if group:
                tokens = float(mask.sum())
                sums["loss"] += float(loss.detach())
                sums["pg_loss"] += float(metrics["pg_loss"])
                sums["entropy"] += float(metrics.get("entropy", torch.tensor(0.0))) * tokens
                sums["clip_frac"] += float(metrics["clip_frac"]) * tokens
                sums["tokens"] += tokens
        if not all(math.isfinite(v) for v in sums.values()):
            finite = False
        finite = all_max(0 if finite else 1) == 0
        self.engine.step()
        applied = self.engine.was_step_applied()
        if not finite and applied:
            raise TrainingError(f"step {self.step + 1}: non-finite loss but DeepSpeed applied the update")
        sums["sequences"] = float(len(active))
        return finite and applied, sums

    def train_step(self) -> dict:
        cfg = self.cfg
        log = StepLog()
        step_start = time.perf_counter()
        epoch, k = divmod(self.step, self.steps_per_epoch)
        batch = epoch_batches(len(self.questions), cfg.train.rollout_batch_size, self.world, cfg.seed, epoch)[k]
        local = batch[self.rank :: self.world]  # this rank's question indices
        questions = [self.questions[i] for i in local]

        # 1. rollouts
        with log.time("rollout"):
            rollouts = self.rollout.generate(
                [self.prompts[i] for i in local],
                n=cfg.rollout.n,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                max_tokens=cfg.rollout.max_tokens,
                seeds=[rollout_seed(cfg.seed, self.step, i) for i in local],
            )  # [b][G]
            self.rollout.sleep()

        # 2. grading
        with log.time("grading"):
            grades = grade(
                questions, [[r.text for r in group] for group in rollouts], cfg.reward.timeout, self.verifier
            )

        # 3. pass rates from every rank; the gate for this epoch was fixed at the last epoch end
        records = all_gather((local, grades.pass_rates, grades.pseudo_correct))
        idx = torch.tensor([i for r in records for i in r[0]])
        self.tracker.record(
            idx, torch.tensor([p for r in records for p in r[1]]), torch.tensor([c for r in records for c in r[2]])
        )
        if cfg.mode == "trapo":
            gate = self.tracker.gate(torch.tensor(local)).tolist()  # [b]
        else:
            gate = [1.0] * len(local)

        # 4. advantages and the update(s)
        seqs = [
            TrainSequence(self.prompts[i] + r.token_ids, len(self.prompts[i]), 0.0, gate[qi], questions[qi].labeled)
            for qi, (i, group) in enumerate(zip(local, rollouts))
            for r in group
        ]  # [b * G], question-major
        rewards = [x for row in grades.rewards for x in row]  # [b * G]
        if cfg.reward.unlabeled != "majority":
            unl = [j for j, s in enumerate(seqs) if not s.labeled]
            with log.time("grading"):
                scores = self._score_sequences([seqs[j] for j in unl], cfg.reward.unlabeled)
            for j, v in zip(unl, scores):
                rewards[j] = v
        g = cfg.rollout.n
        adv = group_advantages(torch.tensor(rewards).view(len(local), g), cfg.loss.advantage_scale)  # [b, G]
        for s, a in zip(seqs, adv.view(-1).tolist()):
            s.advantage = a
        with log.time("update"):
            per_update = cfg.train.update_batch_size // self.world * g  # sequences per rank per optimizer step
            if per_update < len(seqs):  # several updates: later ones need pi_old from before the first
                self._store_old_logprobs(seqs)
            ok, sums = True, {}
            for start in range(0, len(seqs), per_update):
                applied, part = self._update(seqs[start : start + per_update])
                ok &= applied
                sums = {key: sums.get(key, 0.0) + v for key, v in part.items()}
            self.rollout.wake_up()
        total = dict(zip(sums, all_sum(list(sums.values()))))
        n_updates = -(-len(seqs) // per_update)
        tok_sum = max(total["tokens"], 1.0)
        log.values.update(
            # each rank's loss is its share of the global loss times world size (see denom); mean over updates
            loss=total["loss"] / self.world / n_updates if ok else float("nan"),
            pg_loss=total["pg_loss"] / self.world / n_updates,
            entropy=total["entropy"] / tok_sum,
            clip_frac=total["clip_frac"] / tok_sum,
            trained_sequences=int(total["sequences"]),
        )
        # 5. weights into vLLM
        if ok:
            with log.time("weight_push"):
                pushed, _ = self.push_weights()
            log.values["pushed_gb"] = pushed / 2**30

        # statistics over all ranks
        lab = [(p, sum(r)) for q, p, r in zip(questions, grades.pass_rates, grades.rewards) if q.labeled]
        unl = [
            (p, c, w) for q, p, c, w in zip(questions, grades.pass_rates, grades.pseudo_correct, gate) if not q.labeled
        ]
        tokens = sum(len(r.token_ids) for group in rollouts for r in group)
        truncated = sum(r.truncated for group in rollouts for r in group)
        known = [c for _, c, _ in unl if not math.isnan(c)]
        sums = all_sum(
            [
                len(lab),
                sum(p for p, _ in lab),
                len(unl),
                sum(p for p, _, _ in unl),
                sum(w for *_, w in unl),
                len(known),
                sum(known),
                tokens,
                truncated,
                g * len(local),
            ]
        )
        n_lab, lab_pass, n_unl, unl_pass, n_gated_in, n_known, n_right, tok, trunc, n_resp = sums
        log.values.update(
            step=self.step + 1,
            epoch=epoch + 1,
            labeled_questions=int(n_lab),
            unlabeled_questions=int(n_unl),
            reward_labeled=lab_pass / n_lab if n_lab else None,
            pass_rate_labeled=lab_pass / n_lab if n_lab else None,
            pass_rate_unlabeled=unl_pass / n_unl if n_unl else None,
            unlabeled_in_loss=int(n_gated_in),
            selected_unlabeled=int(self.tracker.selected.sum()),  # the gate's current open set
            pseudo_label_precision=n_right / n_known if n_known else None,
            response_tokens=int(tok),
            truncated_frac=trunc / n_resp,
            skipped=not ok,
        )
        if cfg.mode != "supervised":
            log.values["reward_unlabeled"] = unl_pass / n_unl if n_unl and cfg.reward.unlabeled == "majority" else None

        # end of epoch: extend trajectories, select for the next epoch
        if k == self.steps_per_epoch - 1:
            self.last_selection = self.tracker.end_epoch()
            log.values["selection"] = self.last_selection
            if self.is_main and self.last_selection["tcs_selected"] is not None:
                self._dump_selection()
        self.step += 1
        log.timings["step"] = time.perf_counter() - step_start
        log.values["timing"] = {name: round(sec, 4) for name, sec in log.timings.items()}
        log.values["tokens_per_s"] = tok / max(log.timings["rollout"], 1e-9)
        return log.values

    def _dump_selection(self) -> None:
        """Append this epoch's per-question TCS, pseudo-label correctness and gate to selection.jsonl."""
        tr = self.tracker
        idx = (~tr.labeled).nonzero().squeeze(1)  # [U]
        correct = [None if math.isnan(c) else bool(c) for c in tr.last_correct[idx].tolist()]
        row = {
            "epoch": tr.epoch,
            "question": idx.tolist(),
            "tcs": [round(x, 5) for x in tr.scores[idx].tolist()],
            "pseudo_correct": correct,
            "selected": tr.selected[idx].tolist(),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "selection.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, benchmarks: list[Benchmark], n: int, temperature: float, max_tokens: int) -> dict | None:
        """Scores (avg@n) per benchmark and their mean, over all ranks (each takes every world-th question)."""
        if not benchmarks:
            return None
        shards = [Benchmark(b.name, b.questions[self.rank :: self.world], b.source) for b in benchmarks]
        results = evaluate(
            self.rollout,
            self.tokenizer,
            shards,
            n_for=lambda _: n,
            temperature=temperature,
            max_tokens=max_tokens,
            template=self.cfg.data.prompt_template,
            max_prompt_tokens=self.cfg.data.max_prompt_tokens,
            seed=self.cfg.seed,
            verifier=self.verifier,
        )
        grades = all_gather({name: r["_grades"] for name, r in results.items()})
        scores = {name: avg_at_k([g for rank in grades for g in rank[name]]) for name in results}
        return {**scores, "mean": sum(scores.values()) / len(scores)}

    def heldout(self) -> dict | None:
        """pass@1 per test benchmark (data.test_files) and their mean, at rollout.eval_temperature (greedy)."""
        return self.evaluate(self.test_benchmarks, 1, self.cfg.rollout.eval_temperature, self.cfg.rollout.max_tokens)

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        n_lab = sum(q.labeled for q in self.questions)
        self.log(
            f"mode {cfg.mode}: {n_lab} labeled + {len(self.questions) - n_lab} unlabeled questions, "
            f"{self.steps_per_epoch} steps per epoch, {self.total_steps} steps, world size {self.world}"
        )
        before = self.heldout() if self.step == 0 else None
        if before is not None:
            self.log(f"held-out accuracy before training: {before['mean']:.3f}")
        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not (self.is_main and cfg.progress_bar), file=sys.stderr
        )
        metrics_file = open(self.run_dir / "metrics.jsonl", "a") if self.is_main else None
        try:
            while self.step < self.total_steps:
                values = self.train_step()
                save = (cfg.save_steps and self.step % cfg.save_steps == 0) or self.step == self.total_steps
                if cfg.eval.steps and (self.step % cfg.eval.steps == 0 or self.step == self.total_steps):
                    e = cfg.eval
                    values["eval"] = self.evaluate(
                        self.val_benchmarks, e.n, e.temperature, e.max_tokens or cfg.rollout.max_tokens
                    )
                    if self.best is None or values["eval"]["mean"] > self.best["score"]:
                        self.best = {"step": self.step, "score": values["eval"]["mean"]}
                        save = True  # the best checkpoint must exist
                if save:
                    started = time.perf_counter()
                    self.save()
                    values["timing"]["save"] = round(time.perf_counter() - started, 4)
                if metrics_file:
                    metrics_file.write(json.dumps(values) + "\n")
                    metrics_file.flush()
                if values["skipped"]:
                    self.bad_steps += 1
                    self.log(f"step {self.step}: non-finite loss, update skipped ({self.bad_steps} in a row)")
                    if self.bad_steps >= cfg.train.max_bad_steps:
                        last = ckpt.list_complete(self.ckpt_root)
                        raise TrainingError(
                            f"stopping: {self.bad_steps} consecutive steps with a non-finite loss (last at step "
                            f"{self.step}); last good checkpoint: {last[-1][1] if last else 'none'}"
                        )
                else:
                    self.bad_steps = 0
                sel = self.last_selection or {}
                bar.set_postfix(
                    r_lab=_fmt(values.get("reward_labeled")),
                    p_unl=_fmt(values.get("pass_rate_unlabeled")),
                    sel=sel.get("selected", 0),
                    refresh=False,
                )
                bar.update(1)
        finally:
            bar.close()
            if metrics_file:
                metrics_file.close()
        after = self.heldout()
        summary = {
            "steps": self.step,
            "heldout_accuracy_before": before and before["mean"],
            "heldout_accuracy_after": after and after["mean"],
            "heldout_before": before,
            "heldout_after": after,
            "selection": self.last_selection,
            "best": self.best,
        }
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        self.verifier.close()


def _blocks(named_params):
    """Group consecutive (name, param) pairs by block: 'model.layers.3.mlp.up_proj.weight' -> 'model.layers.3'."""
    group, key = [], None
    for name, p in named_params:
        parts = name.split(".")
        digit = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        k = ".".join(parts[: digit + 1]) if digit is not None else ".".join(parts[:-1])
        if group and k != key:
            yield group
            group = []
        group.append((name, p))
        key = k
    if group:
        yield group


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _commit(root: Path, step: int) -> None:
    """Separate so that a test can kill the process exactly between writing and committing."""
    ckpt.commit(root, step)


def _trim_metrics(path: Path, step: int) -> None:
    """On resume, move metrics of steps after the checkpoint (they are redone) aside."""
    if not path.is_file():
        return
    keep, drop = [], []
    for line in path.read_text().splitlines():
        try:
            (keep if json.loads(line)["step"] <= step else drop).append(line)
        except (json.JSONDecodeError, KeyError):
            drop.append(line)
    if drop:
        with open(path.with_name("metrics.discarded.jsonl"), "a") as f:
            f.write("".join(line + "\n" for line in drop))
    path.write_text("".join(line + "\n" for line in keep))


def summary_text(summary: dict) -> str:
    sel = summary.get("selection") or {}
    lines = [f"trained {summary['steps']} steps"]
    if summary.get("heldout_accuracy_before") is not None:
        lines.append(
            f"held-out accuracy: {summary['heldout_accuracy_before']:.3f} before -> "
            f"{summary['heldout_accuracy_after']:.3f} after"
        )
    elif summary.get("heldout_accuracy_after") is not None:
        lines.append(f"held-out accuracy after: {summary['heldout_accuracy_after']:.3f}")
    if sel:
        lines.append(
            f"unlabeled selected at the last epoch end: {sel['selected']} of {sel['unlabeled']} "
            f"(database {sel['database']})"
        )
        ps, pr = sel.get("precision_selected"), sel.get("precision_rejected")
        lines.append(f"pseudo-label precision: selected {_fmt(ps)}, rejected {_fmt(pr)}")
    return "\n".join(lines)


def run(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if trainer.is_main:
        print(summary_text(summary), flush=True)
    return summary
