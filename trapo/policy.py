"""The policy under DeepSpeed ZeRO-3: built from a Hugging Face directory, forwarded in
token-budget micro-batches, updated once per update batch, gathered for the weight push.

Every method that runs the model is collective: ZeRO-3 gathers each layer's
parameters from all ranks, so all ranks run the same number of forward and
backward passes (ranks with less work run empty micro-batches).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from trapo import dist
from trapo.batch import TrainSequence, collate, loss_denominator, pack_by_tokens
from trapo.config import Config, ConfigError
from trapo.logits import token_entropy, token_logprobs
from trapo.loss import policy_loss
from trapo.runtime import torch_dtype

# The update statistics one `update` call returns, summed over its micro-batches (this rank only).
UPDATE_SUMS = ("loss", "pg_loss", "entropy", "clip_frac", "trained_tokens", "trained_sequences")


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss that DeepSpeed applied, too many skipped steps)."""


def model_overrides(cfg: Config) -> dict:
    """Model config values the run sets over the checkpoint's (the same for the policy and vLLM)."""
    overrides = {}
    if cfg.model.rope_theta is not None:
        overrides["rope_theta"] = cfg.model.rope_theta
    if cfg.model.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = cfg.model.max_position_embeddings
    return overrides


class Policy:
    def __init__(self, cfg: Config, model_dir: str, world: int, pad_id: int, hf_overrides: dict):
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        self.cfg, self.world, self.pad_id = cfg, world, pad_id
        self.device = dist.comm_device()
        self.dtype = torch_dtype(cfg.model.dtype)
        try:
            ds_config = json.loads(Path(cfg.train.deepspeed_config).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(
                f"train.deepspeed_config {cfg.train.deepspeed_config}: cannot read JSON ({err})"
            ) from None
        # We micro-batch by tokens ourselves and call step() once per update batch:
        # unmanaged gradient accumulation makes step() the boundary however many backward() calls came first.
        ds_config.update(
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            train_batch_size=world,
            managed_gradient_accumulation=False,
            zero_allow_untested_optimizer=True,
        )
        ds_config["bf16"] = {"enabled": self.dtype == torch.bfloat16}
        ds_config.pop("fp16", None)
        self.ds_config = ds_config
        self._hf_ds = HfDeepSpeedConfig(ds_config)  # must outlive from_pretrained: it turns on zero.Init

        hf_config = AutoConfig.from_pretrained(model_dir)
        for key, value in hf_overrides.items():
            setattr(hf_config, key, value)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config, dtype=self.dtype)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        t = cfg.train
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=t.lr, betas=tuple(t.adam_betas), weight_decay=t.weight_decay
        )
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.model = self.engine.module

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) of every parameter, gathered one block at a time."""
        return dist.gathered_parameters(self.model)

    # ------------------------------------------------------------------ forward passes

    def _microbatches(self, seqs: list[TrainSequence]):
        """Yield (indices into seqs, collated batch) per token-budget micro-batch.

        Ranks with fewer micro-batches add empty ones (indices [], a 2-token dummy
        batch): every rank must run the same number of forward/backward passes.
        """
        groups = pack_by_tokens([len(s.ids) for s in seqs], self.cfg.train.micro_batch_tokens)
        groups += [[] for _ in range(dist.all_max(len(groups)) - len(groups))]
        pad = self.pad_id
        for group in groups:
            if group:
                yield group, collate([seqs[i] for i in group], pad)
            else:
                dummy = TrainSequence(ids=[pad, pad], prompt_len=1, advantage=0.0, weight=0.0, labeled=True)
                yield group, collate([dummy], pad)

    def _forward(self, batch: dict) -> torch.Tensor:
        out = self.engine(
            input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)
        )
        return out.logits[:, :-1].float()  # [b, T-1, V]: position t predicts token t+1

    @torch.no_grad()
    def confidence_scores(self, seqs: list[TrainSequence], kind: str) -> list[float]:
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
    def with_old_logprobs(self, seqs: list[TrainSequence]) -> list[TrainSequence]:
        """The sequences with pi_old's log-probs of their response tokens attached (several updates per batch)."""
        out = list(seqs)
        for group, batch in self._microbatches(seqs):
            logits = self._forward(batch)
            lp = token_logprobs(logits, batch["input_ids"][:, 1:].to(logits.device)).cpu()  # [b, T-1]
            for row, i in enumerate(group):
                s = seqs[i]
                out[i] = replace(s, old_logprobs=lp[row, s.prompt_len - 1 : len(s.ids) - 1].tolist())
        return out

    # ------------------------------------------------------------------ the update

    def update(self, seqs: list[TrainSequence], step: int) -> tuple[bool, dict[str, float]]:
        """One optimizer step on this rank's sequences of an update batch.

        Returns (applied, this rank's UPDATE_SUMS: loss, pg_loss, token-weighted
        entropy and clip fraction, response tokens and sequences trained);
        applied is False when a non-finite loss on any rank made the step be skipped.
        """
        cfg = self.cfg
        # Denominators over the whole update batch on all ranks (gated sequences included),
        # divided by the world size because DeepSpeed averages gradients over ranks.
        counts = dist.all_sum({"sequences": len(seqs), "tokens": sum(len(s.ids) - s.prompt_len for s in seqs)})
        denom = (
            loss_denominator(cfg.loss.agg, int(counts["sequences"]), int(counts["tokens"]), cfg.rollout.max_tokens)
            / self.world
        )
        active = [s for s in seqs if s.weight != 0.0]  # a gated-out sequence adds nothing: skip its compute
        finite = True
        sums = dict.fromkeys(UPDATE_SUMS, 0.0)
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
                sums["trained_tokens"] += tokens
        if not all(math.isfinite(v) for v in sums.values()):
            finite = False
        finite = dist.all_max(0 if finite else 1) == 0
        self.engine.step()
        applied = self.engine.was_step_applied()
        if not finite and applied:
            raise TrainingError(f"step {step + 1}: non-finite loss but DeepSpeed applied the update")
        sums["trained_sequences"] = float(len(active))
        return finite and applied, sums
