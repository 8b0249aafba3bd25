"""The policy under DeepSpeed ZeRO-3: built from a Hugging Face directory, forwarded in
token-budget micro-batches (packed without padding, trapo/engine/packing.py), updated once per
update batch, gathered for the weight push.

Every method that runs the model is collective: ZeRO-3 gathers each layer's
parameters from all ranks, so all ranks run the same number of forward and
backward passes (ranks with less work run empty micro-batches; `balance` evens
the work out first).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from trapo import console
from trapo.algorithm.importance import top_p_bias_warning
from trapo.algorithm.logits import TokenStats, lm_head_token_stats, scatter_to_mask
from trapo.algorithm.loss import PolicyLoss
from trapo.config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, read_deepspeed_config
from trapo.engine import attention, dist, fused_ops, lora, packing
from trapo.engine.batch import TrainSequence, collate
from trapo.engine.memory_terms import check_stage
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
    "logprob_gap",  # sum over them of log pi_engine - log pi_old: a k1 estimate of KL(engine || policy) per token
    "is_weight",  # token-weighted sum of the rollout importance weights (loss.rollout_is)
    "is_capped",  # token-weighted sum of the fraction of weights at the cap
    "is_tokens",  # tokens that had importance weights
    "is_masked",  # token-weighted sum of the fraction of tokens a mask mode dropped (loss.rollout_is)
    "is_masked_seqs",  # sequences with at least one dropped token (sequence_mask: the dropped sequences)
    "is_seqs",  # sequences that had importance weights
    "kl_ref",  # token-weighted sum of the k3 estimate of KL(pi_theta || pi_ref) (loss.beta > 0)
    "kl_tokens",  # tokens that had reference log-probs
    "overlong_penalty",  # sum of DAPO's R_len over the step's responses (loss.overlong=soft_penalty; the trainer's)
    "overlong_responses",  # responses that R_len was computed for
)


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss that DeepSpeed applied, too many skipped steps)."""


def model_overrides(model: ModelConfig, hf_config) -> dict:
    """Model config attributes the run sets over the checkpoint's, as both transformers and vLLM read them.

    transformers 5.19 builds the rotary embedding from `rope_parameters["rope_theta"]`
    only (an attribute `rope_theta` is ignored), and vLLM 0.32 passes
    `rope_parameters` to its rotary layer as given in `hf_overrides`; so the
    override is the checkpoint's whole `rope_parameters` with the new theta.
    """
    overrides = {}
    if model.rope_theta is not None:
        rope = dict(getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"})
        overrides["rope_parameters"] = {**rope, "rope_theta": float(model.rope_theta)}
    if model.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = model.max_position_embeddings
    return overrides


def same_model(policy: dict, engine: dict) -> str:
    """Compare the policy's and the engine's `effective_config`; a line for the log, or ConfigError naming
    each key that differs. RoPE theta is read back from the policy's inverse frequencies, stored in its
    dtype: it agrees to a relative 1e-4 in fp32, 1e-2 in bf16 (a wrong override is off by 4x, not 1%)."""
    bad = []
    for key, a in policy.items():
        b = engine.get(key)
        if key == "rope_theta" and a is not None and b is not None:
            same = abs(a - b) <= (1e-4 if policy.get("dtype") == "float32" else 1e-2) * abs(b)
        else:
            same = a == b
        if not same:
            bad.append(f"{key}: policy {a}, engine {b}")
    if bad:
        raise ConfigError("the policy and the vLLM engine run different models: " + "; ".join(bad))
    return "policy and engine agree: " + ", ".join(
        f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in policy.items()
    )


def _offloadable_states(wanted: bool) -> list | None:
    """What DeepSpeed 0.19's `offload_states` can move with our torch optimizer (None: nothing).

    Under ZeRO-3 it moves the fp32 master weights and Adam moments only for its
    own FusedAdam (it asserts so: docs/upstream-notes.md); with a torch
    optimizer the low-precision parameter partitions and the gradient buffers
    move. `Policy.offload` moves the fp32 master weights and Adam moments itself.
    """
    if not wanted:
        return None
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

    return [State.lp_params, State.lp_grads, State.contiguous_grad_buffer]


class Policy:
    """The policy of `model_dir` as the run's `model`, `train` and `rollout` settings shape it (the sampling
    temperature: its log-probs are the sampler's), updated by `loss`; `seed` seeds the LoRA adapters.
    `checkpointing`: recompute each layer in the backward, as `memory_plan.checkpointing_needed` decided
    model.gradient_checkpointing (whose auto only the plan resolves)."""

    def __init__(
        self,
        model_dir: str,
        world: int,
        pad_id: int,
        *,
        model: ModelConfig,
        train: TrainConfig,
        rollout: RolloutConfig,
        loss: PolicyLoss,
        checkpointing: bool,
        seed: int = 0,
    ):
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        self.world, self.pad_id = world, pad_id
        self.train_cfg, self.temperature = train, rollout.temperature
        self.min_tokens, self.held_ids = rollout.min_tokens, None  # see `hold_back`
        self.loss = loss  # what `update` calls; the config's loss keys are read only through it
        self.device = dist.comm_device()
        dtype = torch_dtype(model.dtype)
        hf_config = AutoConfig.from_pretrained(model_dir)
        if model.lora.rank > 0:  # a bad target: one line before any weight is read (the architecture alone)
            lora.check_config_targets(hf_config, model.lora.target_modules)
        ds_config = read_deepspeed_config(train.deepspeed_config)
        check_stage((ds_config.get("zero_optimization") or {}).get("stage", 3), model.lora.rank)
        if "auto" in (train.loss_chunk_tokens, train.param_persistence):
            raise ValueError("Policy: train's auto settings undecided; pass the planned config (settings.planned)")
        if train.param_persistence:  # every parameter kept whole after its first gather: no per-module gathers
            everything = dict(stage3_param_persistence_threshold=10**15, stage3_model_persistence_threshold=10**15)
            ds_config["zero_optimization"] = {**(ds_config.get("zero_optimization") or {}), **everything}
        # We micro-batch by tokens ourselves and call step() once per update batch:
        # unmanaged gradient accumulation makes step() the boundary however many backward() calls came first.
        ds_config.update(
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            train_batch_size=world,
            managed_gradient_accumulation=False,
            zero_allow_untested_optimizer=True,
        )
        ds_config["bf16"] = {"enabled": dtype == torch.bfloat16}
        ds_config.pop("fp16", None)
        self._hf_ds = HfDeepSpeedConfig(ds_config)  # must outlive from_pretrained: it turns on zero.Init

        self.overrides = model_overrides(model, hf_config)  # the engine takes the same
        for key, value in self.overrides.items():
            setattr(hf_config, key, value)
        net = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config, dtype=dtype)
        if checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        net.config.use_cache = False
        if model.fused_kernels:
            routed = fused_ops.fuse(net, fused_ops.Kernels())
            console.say("fused kernels in the update: " + ", ".join(f"{n} {k}" for k, n in routed.items()))
        if train.packing:  # packed rows: attention within each sequence, no [S, S] mask
            net.set_attn_implementation(attention.register_attention())
            # the kernel is chosen here, before any forward: a check inside a checkpointed forward breaks its backward
            attention.choose_kernel(hf_config, self.device, dtype)
        # model.lora: adapters on a frozen base (trapo/engine/lora.py); the base's identity goes in checkpoints
        self.lora = model.lora.rank > 0
        self.base = None
        if self.lora:
            net = lora.attach(net, model.lora, seed=seed)
            self.base = dist.all_gather(lora.base_identity(model_dir) if dist.rank() == 0 else None)[0]
            console.say(lora.describe(net, model.lora))
        on_gpu = torch.cuda.is_available()
        optimizer = torch.optim.AdamW(
            [p for p in net.parameters() if p.requires_grad],  # with LoRA: the adapters alone
            lr=train.lr,
            betas=tuple(train.adam_betas),
            weight_decay=train.weight_decay,
            fused=on_gpu,
        )
        self.engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=ds_config)
        self.model = self.engine.module
        # loss.beta > 0: a frozen copy of the initial weights for the KL term, partitioned by ZeRO-3 like the
        # policy (each rank holds 1/world of it) and run forward only; no optimizer, never saved.
        # With LoRA the reference is the base itself: the same model with its adapters off (`_reference`).
        self.ref = None
        if loss.spec.needs_reference and not self.lora:
            ref = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config, dtype=dtype).requires_grad_(False)
            ref.config.use_cache = False
            if train.packing:
                ref.set_attn_implementation(attention.ATTENTION)
            ref_config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
            self.ref, *_ = deepspeed.initialize(model=ref, config=ref_config)
            self.ref.eval()
        bias = top_p_bias_warning(loss.rollout_is, rollout.top_p)
        if bias:
            console.warn_once("rollout_is_top_p", bias)
        # The hf backend generates with the bf16 partitions themselves: they stay (validation refuses true).
        offload = train.offload_during_rollout
        if offload is None:  # a colocated vLLM engine needs the room; separate rollout ranks generate elsewhere
            offload = on_gpu and rollout.backend == "vllm" and rollout.placement != "separate"
        # With LoRA nothing moves: the adapters' states are small, and DeepSpeed's lp_params offload maps a
        # frozen base onto the trainable partitions' buffer, which breaks it (docs/upstream-notes.md).
        self.offload_states = _offloadable_states(offload and not self.lora)
        if self.lora and train.offload_during_rollout:
            console.warn_once(
                "lora_offload",
                "train.offload_during_rollout=true moves nothing with model.lora: "
                "the frozen base stays on the device (the plan counts it in rollouts)",
            )
        self.scale = lora.scalings(self.model) if self.lora else {}
        self.offloaded = False
        self._host: dict[int, torch.Tensor] = {}  # host copies of the fp32 master and Adam moments, by tensor
        self.moved = {"offload_s": 0.0, "reload_s": 0.0, "bytes": 0}  # the last offload's figures (metrics.jsonl)

    def effective_config(self) -> dict:
        """What the policy's model uses: RoPE theta (read back from its rotary inverse frequencies),
        positions, vocabulary, dtype. Compared with `RolloutEngine.effective_config` at start-up."""
        rotary = next(m for m in self.model.modules() if hasattr(m, "inv_freq"))
        inv_freq = rotary.inv_freq.double()  # [d/2]: theta ** (-i / (d/2)); in the model's dtype
        last = inv_freq.numel() - 1  # the last entry: its rounding error is not amplified
        theta = float(inv_freq[last] ** (-inv_freq.numel() / last)) if last > 0 else None
        c = self.model.config
        return {
            "rope_theta": theta,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
        }

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) of every parameter, gathered one block at a time; with LoRA the
        adapted layers' weights merged (W + alpha / r B A), the adapters themselves not listed."""
        if self.lora:
            return lora.merged(dist.gathered_parameters(self.model), self.scale)
        return dist.gathered_parameters(self.model)

    def base_model(self) -> torch.nn.Module:
        """The transformers model (under peft's wrapper with LoRA): its config and generation config."""
        return self.model.get_base_model() if self.lora else self.model

    def _reference(self):
        """(DeepSpeed engine, a context for each forward) that computes the KL reference's log-probs: the
        frozen copy, or with LoRA the policy with its adapters disabled."""
        if self.lora:
            return self.engine, self.model.disable_adapter
        if self.ref is None:  # without it the policy's own log-probs would pass for the reference's
            raise ValueError("ref_logprobs need a reference model, which is loaded only when loss.beta > 0")
        return self.ref, contextlib.nullcontext

    # ------------------------------------------------------------------ forward passes

    def _groups(self, seqs: list[TrainSequence]) -> list[list[int]]:
        """This rank's micro-batches (indices into seqs), padded with empty ones to the busiest rank's count:
        every rank must run the same number of forward/backward passes."""
        groups = packing.micro_batches(
            [len(s.ids) for s in seqs], self.train_cfg.micro_batch_tokens, self.train_cfg.packing
        )
        # At least one pass even when nothing is trainable anywhere: DeepSpeed's step needs a backward.
        return groups + [[] for _ in range(max(dist.all_max(len(groups)), 1) - len(groups))]

    def _microbatches(self, seqs: list[TrainSequence], groups: list[list[int]] | None = None):
        """Yield (indices into seqs, collated batch) per micro-batch; an empty group runs a 2-token dummy."""
        pad, build = self.pad_id, packing.collate_packed if self.train_cfg.packing else collate
        for group in self._groups(seqs) if groups is None else groups:
            if group:
                yield group, build([seqs[i] for i in group], pad)
            else:
                dummy = TrainSequence(ids=[pad, pad], prompt_len=1, advantage=0.0, weight=0.0, labeled=True)
                yield group, build([dummy], pad)

    def hold_back(self, stop_token_ids: list[int]) -> None:
        """The stop tokens the engine holds back before rollout.min_tokens response tokens: the policy's
        log-probs and entropy at those positions are then of the distribution the engine sampled from (the
        softmax without them), so the importance weights and the health check compare like with like."""
        if self.min_tokens > 0 and stop_token_ids:
            self.held_ids = torch.tensor(stop_token_ids, dtype=torch.long, device=self.device)

    def _token_stats(self, batch: dict, *, entropy: bool = False, kl_uniform: bool = False, engine=None) -> TokenStats:
        """Log-probs (and entropy, KL(U || p)) of the response tokens, [b, T-1] each, 0 elsewhere.

        The transformer runs without its LM head (`logits_to_keep` selects no
        position, so no [T, V] logits exist); the head is then applied to the
        response positions only, a chunk of `train.loss_chunk_tokens` rows at a
        time with recomputation in backward, at the sampling temperature.
        `engine`: the DeepSpeed engine to run (default the policy's; the reference model's for the KL).
        """
        engine = self.engine if engine is None else engine
        mask = batch["response_mask"].to(self.device)  # [b, T-1]: position t predicts token t+1
        no_logits = torch.empty(0, dtype=torch.long, device=self.device)
        if "packed_ids" in batch:  # one row [1, S]; its response positions come in the padded mask's order
            ids, rows = batch["packed_ids"].to(self.device), batch["packed_response"].to(self.device)
            out = engine(
                input_ids=ids,
                position_ids=batch["packed_positions"].to(self.device),
                attention_mask=None,
                packed_bounds=batch["packed_bounds"],
                output_hidden_states=True,
                logits_to_keep=no_logits,
            )
        else:
            ids, rows = batch["input_ids"].to(self.device), mask
            out = engine(
                input_ids=ids,
                attention_mask=batch["attention_mask"].to(self.device),
                output_hidden_states=True,
                logits_to_keep=no_logits,
            )
        hidden = out.hidden_states[-1][:, :-1][rows]  # [N, H], after the final norm: what the head reads
        targets = ids[:, 1:][rows]  # [N]
        held = {}
        if self.held_ids is not None and not kl_uniform:  # self-certainty is of the model's own distribution
            index = mask.long().cumsum(-1) - 1  # [b, T-1]: which response token each position predicts
            held = dict(held_rows=(index < self.min_tokens)[mask], held_ids=self.held_ids)
        stats = lm_head_token_stats(
            hidden,
            engine.module.get_output_embeddings(),
            targets,
            temperature=self.temperature,
            chunk_tokens=self.train_cfg.loss_chunk_tokens,
            entropy=entropy,
            kl_uniform=kl_uniform,
            **held,
        )
        return TokenStats(*(None if s is None else scatter_to_mask(s, mask) for s in stats))

    @torch.no_grad()
    def confidence_scores(self, seqs: list[TrainSequence], kind: str) -> list[float]:
        """Confidence rewards from the current policy (no gradient), one per sequence."""
        from trapo.algorithm.rewards.confidence import confidence_reward

        scores = [0.0] * len(seqs)
        for group, batch in self._microbatches(seqs):
            stats = self._token_stats(batch, entropy=kind == "token_entropy", kl_uniform=kind == "self_certainty")
            values = confidence_reward(kind, stats, batch["response_mask"].to(self.device))
            for i, v in zip(group, values.tolist()):
                scores[i] = v
        return scores

    @torch.no_grad()
    def with_logprobs(self, seqs: list[TrainSequence], field: str) -> list[TrainSequence]:
        """The sequences with log-probs of their response tokens attached as `field`:
        "old_logprobs" from the policy now (pi_old, for several updates per batch) or
        "ref_logprobs" from the reference model (loss.beta > 0)."""
        engine, context = self._reference() if field == "ref_logprobs" else (self.engine, contextlib.nullcontext)
        out = list(seqs)
        for group, batch in self._microbatches(seqs):
            with context():
                lp = self._token_stats(batch, engine=engine).logprobs.cpu()  # [b, T-1]
            for row, i in enumerate(group):
                s = seqs[i]
                out[i] = replace(s, **{field: lp[row, s.prompt_len - 1 : len(s.ids) - 1].tolist()})
        return out

    # ------------------------------------------------------------------ memory while vLLM generates

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The fp32 master partitions and the torch optimizer's Adam moments: 12 bytes per parameter over the
        world size, which DeepSpeed will not move for a torch optimizer (the moments exist after step 1)."""
        zero = self.engine.optimizer
        out = list(getattr(zero, "fp32_partitioned_groups_flat", []))
        for state in zero.optimizer.state.values():
            out += [state[key] for key in ("exp_avg", "exp_avg_sq") if key in state]
        return out

    def offload(self) -> None:
        """Move the optimizer's states and the partitions to host memory while the engine generates.

        DeepSpeed moves the bf16 partitions and gradient buffers; the fp32 master weights and Adam moments
        are copied here into pinned host buffers kept outside `optimizer.state` (so its state_dict and the
        checkpoints are unchanged) and the device tensors point at them (`.data`, as DeepSpeed does for
        its own FusedAdam), until `reload` copies them back before the update.
        """
        if self.offload_states:
            start = time.perf_counter()
            self.engine.offload_states(include=self.offload_states)
            pin, moved = torch.cuda.is_available(), 0
            for tensor in self._optimizer_tensors():
                host = self._host.get(id(tensor))
                if host is None or host.shape != tensor.shape:
                    host = self._host[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                if host.data_ptr() != tensor.data_ptr():
                    host.copy_(tensor, non_blocking=pin)
                tensor.data = host
                moved += tensor.numel() * tensor.element_size()
            if pin:
                torch.cuda.synchronize()
            self.moved = {"offload_s": time.perf_counter() - start, "reload_s": 0.0, "bytes": moved}
            self.offloaded = True
        if torch.cuda.is_available():  # the update's freed activations: back to the device, for vLLM
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if self.offloaded:
            start = time.perf_counter()
            self.engine.reload_states()
            for tensor in self._optimizer_tensors():
                tensor.data = tensor.data.to(self.device, non_blocking=True)  # on CPU: the host copy itself
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.moved["reload_s"] = time.perf_counter() - start
            self.offloaded = False

    # ------------------------------------------------------------------ the update

    def trainable(self, seqs: list[TrainSequence]) -> list[TrainSequence]:
        """The sequences worth a forward and backward (`LossSpec.trains`); the denominators still count the
        skipped ones, and under loss.overlong=mask drop the truncated ones too (`PolicyLoss.counts`)."""
        return [s for s in seqs if self.loss.spec.trains(s.advantage, s.weight, s.truncated)]

    def balance(self, seqs: list[TrainSequence]) -> list[TrainSequence]:
        """This rank's share of every rank's `seqs`, token counts nearly equal across ranks (collective).
        The union over ranks is unchanged, so the update's sums and denominators are too."""
        gathered = dist.all_gather(seqs)  # token ids, advantages, log-probs: small next to the update
        plan = packing.balance([[len(s.ids) for s in part] for part in gathered])
        return [gathered[r][i] for r, i in plan[dist.rank()]]

    def update(
        self, seqs: list[TrainSequence], step: int, batch: dict[str, float], entropy_coef: float | None = None
    ) -> tuple[bool, dict[str, float], dict[str, int]]:
        """One optimizer step on this rank's trainable sequences of an update batch.

        batch: the whole update batch's "sequences" and response "tokens" on all ranks (gated and
        skipped sequences included), for the loss denominators. Returns (applied, this rank's
        UPDATE_SUMS, the update's work counts over all ranks, `packing.work_counts`); applied is False
        when a non-finite loss on any rank made the step be skipped. entropy_coef: the bonus's weight this
        step (loss.entropy_target's adaptive coefficient); None: the LossSpec's. The sums stay on the device until
        the end of the update: one host synchronisation.
        """
        groups = self._groups(seqs)
        # The work done, for update_efficiency: every rank's micro-batch layout and its tokens with signal.
        signal = sum(len(s.ids) for s in seqs if self.loss.spec.carries_signal(s.advantage))
        layouts = dist.all_gather(([[len(seqs[i].ids) for i in g] for g in groups if g], signal))
        work = packing.work_counts([lay for lay, _ in layouts], sum(n for _, n in layouts), self.train_cfg.packing)
        sums = torch.zeros(len(UPDATE_SUMS) + 1, dtype=torch.float64, device=self.device)  # + non-finite count
        self.engine.train()
        for group, micro in self._microbatches(seqs, groups):
            # the entropy is always measured: the bonus, its controller and the rambling guard read it
            stats = self._token_stats(micro, entropy=True)  # [b, T-1] each
            # pi_old, the sampler's and the reference's log-probs, where the sequences carry them
            given = {
                k: micro[k].to(self.device) for k in ("old_logprobs", "engine_logprobs", "ref_logprobs") if k in micro
            }
            loss, part = self.loss(
                stats.logprobs,
                micro["response_mask"].to(self.device),  # [b, T-1]
                micro["advantages"].to(self.device),
                micro["weights"].to(self.device),
                counts=batch,
                entropy=stats.entropy,
                entropy_coef=entropy_coef,
                **given,
            )
            if not group:
                loss = loss * 0.0
            # A non-finite loss still goes through backward: its NaN gradient makes DeepSpeed's
            # global gradient-norm check discard the whole step on every rank (no rank diverges).
            self.engine.backward(loss)
            if group:
                sums[:-1] += torch.stack(
                    [torch.as_tensor(part.get(k, 0.0), dtype=torch.float64, device=self.device) for k in UPDATE_SUMS]
                )
            sums[-1] += (~torch.isfinite(loss.detach())).double()
        values = sums.tolist()  # the update's one host synchronisation
        out = dict(zip(UPDATE_SUMS, values))
        finite = dist.all_max(int(values[-1] > 0 or not all(math.isfinite(v) for v in values))) == 0
        self.engine.step()
        applied = self.engine.was_step_applied()
        if not finite and applied:
            raise TrainingError(f"step {step + 1}: non-finite loss but DeepSpeed applied the update")
        out["trained_sequences"] = float(len(seqs))
        return finite and applied, out, work
