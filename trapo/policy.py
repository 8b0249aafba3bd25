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
UPDATE_SUMS = (
    "loss",
    "pg_loss",
    "entropy",
    "clip_frac",
    "trained_tokens",
    "trained_sequences",
    "logprob_diff",  # sum over trained tokens of |log pi_old - log pi_engine| (the rollout engine's health)
    "logprob_tokens",  # tokens that had engine log-probs
)


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss that DeepSpeed applied, too many skipped steps)."""


def model_overrides(cfg: Config, hf_config) -> dict:
    """Model config attributes the run sets over the checkpoint's, as both transformers and vLLM read them.

    transformers 5.19 builds the rotary embedding from `rope_parameters["rope_theta"]`
    only (an attribute `rope_theta` is ignored), and vLLM 0.32 passes
    `rope_parameters` to its rotary layer as given in `hf_overrides`; so the
    override is the checkpoint's whole `rope_parameters` with the new theta.
    """
    overrides = {}
    if cfg.model.rope_theta is not None:
        rope = dict(getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"})
        overrides["rope_parameters"] = {**rope, "rope_theta": float(cfg.model.rope_theta)}
    if cfg.model.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = cfg.model.max_position_embeddings
    return overrides


def same_model(policy: dict, engine: dict) -> str:
    """Compare the policy's and the engine's `effective_config`; a line for the log, or ConfigError naming
    each key that differs. RoPE theta agrees to a relative 1e-4 (the policy's is read back from fp32)."""
    bad = []
    for key, a in policy.items():
        b = engine.get(key)
        if key == "rope_theta" and a is not None and b is not None:
            same = abs(a - b) <= 1e-4 * abs(b)
        else:
            same = a == b
        if not same:
            bad.append(f"{key}: policy {a}, engine {b}")
    if bad:
        raise ConfigError("the policy and the vLLM engine run different models: " + "; ".join(bad))
    return "policy and engine agree: " + ", ".join(
        f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in policy.items()
    )


class Policy:
    def __init__(self, cfg: Config, model_dir: str, world: int, pad_id: int):
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
        self.overrides = model_overrides(cfg, hf_config)  # the engine takes the same
        for key, value in self.overrides.items():
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

    def effective_config(self) -> dict:
        """What the policy's model uses: RoPE theta (read back from its rotary inverse frequencies),
        positions, vocabulary, dtype. Compared with `RolloutEngine.effective_config` at start-up."""
        rotary = next(m for m in self.model.modules() if hasattr(m, "inv_freq"))
        inv_freq = rotary.inv_freq.double()  # [d/2]: theta ** (-2i / d)
        head_dim = 2 * inv_freq.numel()
        theta = float(inv_freq[1] ** (-head_dim / 2)) if inv_freq.numel() > 1 else None
        c = self.model.config
        return {
            "rope_theta": theta,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
        }

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
        # [b, T-1, V]: position t predicts token t+1. Divided by the sampling temperature, so that log-probs,
        # ratios and entropies are those of the distribution vLLM sampled from (exact no-op at 1.0).
        return out.logits[:, :-1].float() / self.cfg.rollout.temperature

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
        entropy and clip fraction, response tokens and sequences trained, the
        engine-vs-policy log-prob difference and its token count);
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
            if group and "engine_logprobs" in batch:
                engine_lp = batch["engine_logprobs"].to(logits.device)
                sums["logprob_diff"] += float(torch.where(mask, (old - engine_lp).abs(), 0.0).sum())
                sums["logprob_tokens"] += float(mask.sum())
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
