"""The memory plan's terms: per-GPU bytes of a run at its three moments (start-up, rollout, update), from a
config whose settings are decided (memory_plan.py resolves the auto ones first), with no GPU and no weights.

    items_by_phase, kv = phases(cfg, world, gpu_bytes, arch, zero_settings(ds_config, b), util, T)

Pure arithmetic (the architecture comes from trapo/engine/model_shapes.py). Symbols: P parameters, w world
size, s = ceil(P / w) one rank's ZeRO-3 partition, b bytes of the model dtype (2, bf16), g bytes of
DeepSpeed's gradient accumulation dtype (`data_types.grad_accum_dtype`, else the model dtype; 4 with
configs/deepspeed_zero3.json).
Where each term comes from in the pinned deepspeed, vLLM and transformers (file:line, dated), and the one
term a GPU has measured: docs/memory-plan.md, "Where each term comes from".

ZeRO-3 partitions (DeepSpeed's own estimator counts the same 18 B/param / w without offload; its 4 B x
largest layer is replaced by the gathered-params term below):
  b*s bf16 params, g*s gradient partitions (one flat buffer), 4*s fp32 master (a copy unless the model is
  fp32), 8*s Adam moments (torch AdamW creates them at the first step), b*reduce_bucket_size IPG bucket.
Start-up: vLLM is built after the policy, before any step: the trainer holds b*s + g*s + 4*s + IPG; vLLM
  requests ceil(util * card) and refuses to start when less is free.
Rollout (steady state, from step 2): train.offload_during_rollout moves b*s, g*s and the IPG bucket to
  the host through DeepSpeed, and the 4*s master + 8*s moments through `Policy.offload` (DeepSpeed's
  offload_states moves those only for its own FusedAdam); without it all of them stay. vLLM takes
  ceil(util * card) in all. Its KV cache is sized once at build: util * card - weights - profile activation
  peak - non-torch/CUDA graphs; sleep releases and re-maps it, never grows it.
  Weights b*P/tp. Profile peak: the larger of a forward of max_num_batched_tokens, N * b * (3 I/tp + 4 H)
  (gate_up output [N, 2I], its SiluAndMul [N, I], hidden-size buffers), and the sampler over max_num_seqs
  rows, S * V * 4 * 3 (fp32 logits, processed log-probs, top-p sort buffer); N, S = 16384, 1024 on cards
  of >= 70 GiB, else 8192, 256. KV bytes per token = 2 (K, V) * layers * kv_heads/tp * head_dim * b;
  blocks of 16 tokens; sequences held = KV // (bytes per token * 16 * ceil((max_prompt_tokens + max_tokens)
  / 16)). Needed: each engine generates rollout_batch_size / w * tp questions x n. Fewer held: vLLM queues
  (slower), a warning.
Update (vLLM asleep at level 2: weights and KV cache released): the partitions above, plus
  gathered params b * min(P, stage3_max_live_parameters + largest module) (prefetch stops at max_live;
    the module running is fetched anyway), and the larger of
  backward: (layers + 1) * T * H * b checkpointed layer inputs (and the final hidden state), T =
    max(train.micro_batch_tokens, max_prompt_tokens + max_tokens) (a longer sequence gets a micro-batch of
    its own, trapo/engine/packing.py), plus the larger of one layer recomputed, T * b * (20 H + 4 kv_dim + 6 I) +
    T * heads * 4, and the LM head's backward, 4 fp32 [chunk, V] (trapo/algorithm/logits.py) + fp32 and bf16
    [V, H] weight gradient + [T, H] hidden and its gradient;
  optimizer step: 4 * min(s, sub_group_size) flattened fp32 gradient.
  The 20 / 4 / 6 of a recomputed Qwen2/Llama layer (sdpa with enable_gqa): two RMSNorms at 5 [T, H] units
  each (fp32 upcast and product, bf16 output), q and its RoPE (3), per-sequence sdpa output and its
  concatenation (2), o_proj output and residual (2), gradients in flight (3); k, v, k after RoPE and its
  rotate_half (4 [T, kv_dim]); gate, up, silu(gate), product (4 [T, I]) and two gradients.
hf backend (rollout.backend: hf, no vLLM): nothing at start-up beyond the trainer; during rollouts every
  state stays (nothing is offloaded) and the policy itself generates: the whole model gathered, b*P, a KV
  cache of min(hf_max_batch, the rank's sequences) x (max_prompt_tokens + max_tokens) x bytes per token, and
  the larger of two peaks never live at once: the sampler's fp32 [batch, V] rows (logits, log-softmax, noise,
  top-p sort: 4 of them), and one prefill forward's activations. Prompts are prefilled R = min(batch,
  max(1, HF_PREFILL_TOKENS // max_prompt_tokens)) whole rows at a time (trapo/engine/hf_rollout.py
  `_prefill`), N = R x max_prompt_tokens tokens: N * (b * (3 I + 4 H + 2 head_dim) + max_prompt_tokens) at
  the MLP's product: silu(gate), up and their product [N, I]; four [N, H], the embeddings (held through the
  forward), the layer's input (held by the model's loop), the attention's residual sum and the MLP's normed
  input; RoPE's cos and sin [N, head_dim]; the sdpa mask, N x max_prompt_tokens booleans. Attention holds
  less where I > 2 H, as in the table's models (about 7 [N, H]: input, normed input, q, k and v repeated to
  every head, output). The KV cache is counted at its full length, which it reaches after the prefill.
LoRA (model.lora.rank > 0): P_t = rank x (in + out) per adapted projection and layer trains; s_t = ceil(P_t / w)
  takes s's place in the gradient, fp32 master and Adam terms (DeepSpeed builds them from the optimizer's
  parameters only). The frozen base is b*s, kept in rollouts (offload_states would map it onto the
  trainable buffer, so nothing moves); the LM head has no [V, H] weight gradient; no reference copy (the
  base with adapters off). ZeRO-2 (LoRA only): the base and adapters whole, b*P + b*P_t (frozen parameters
  stay whole; only the trainable ones are flattened), gradients and states over w as above, nothing gathered.
Gradient checkpointing (model.gradient_checkpointing): true counts the checkpointed layer inputs and one layer
  recomputed above, false every layer's activations, `layers` x one layer's.
Parameter persistence (train.param_persistence, ZeRO-3): every parameter kept gathered after its first use
  (DeepSpeed keeps a persistent parameter's partition and its whole tensor): b*P whole besides the partitions
  in the rollout and update phases, and nothing gathered or released per module (the update's gathered-params
  term and the hf backend's gathered model are 0).
Not computed, margins: RESERVE (CUDA context, NCCL buffers, allocator fragmentation) in every phase and
  VLLM_RUNTIME (vLLM's non-torch memory and CUDA graph pool, in its share; kept while asleep).
Ignored (< 1 MB): parameters under stage3_param_persistence_threshold kept whole on every rank (without
  train.param_persistence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trapo.config import Config, ConfigError
from trapo.engine.model_shapes import Arch

GiB = 2**30
RESERVE = 2 * GiB
VLLM_RUNTIME = 1 * GiB
LAYER_H, LAYER_KV, LAYER_I = 20, 4, 6  # [T, H], [T, kv_dim], [T, I] tensors of one recomputed layer
HEAD_CHUNKS = 4  # fp32 [chunk, V] tensors alive in the LM head's backward (trapo/algorithm/logits.py)
BLOCK = 16  # vLLM's KV-cache block, tokens
# Prompt tokens (padding included) in one prefill forward of the hf backend (HfEngine's default), kept here so
# the plan imports no torch; 16,384 is what vLLM batches per step on a >= 70 GiB card.
HF_PREFILL_TOKENS = 16384
PREFILL_I, PREFILL_H = 3, 4  # [N, I] and [N, H] tensors live at a no-grad forward's peak (the MLP's product)
_DTYPE_BYTES = {n: 4 for n in ("fp32", "float32", "float", "torch.float32")} | {
    n: 2 for n in ("bf16", "bfloat16", "torch.bfloat16", "fp16", "float16", "half", "torch.float16")
}  # DeepSpeed's DtypeEnum names


@dataclass
class Item:
    name: str
    bytes: int
    counted: bool = True  # part of the phase's peak (False: shown for reference, not at the same time)


@dataclass(frozen=True)
class Zero:
    stage: int  # 3; or 2, for LoRA only: the frozen base whole on every rank, nothing gathered
    grad_bytes: int
    bucket: int  # reduce_bucket_size, elements (0 without contiguous_gradients)
    max_live: int
    sub_group: int


def check_stage(stage: int, lora_rank: int) -> None:
    """ZeRO stage 2 serves LoRA runs only (the policy and the plan both hold to it): full fine-tuning's code
    paths (offload, resharding) and the plan's formulas for it are ZeRO-3's."""
    if stage != 3 and not lora_rank:
        raise ConfigError(
            "train.deepspeed_config: ZeRO stage 2 is for LoRA runs (model.lora.rank > 0), where the frozen base is "
            "held whole on every GPU; full fine-tuning runs under ZeRO-3 (configs/deepspeed_zero3.json)"
        )


def zero_settings(ds_config: dict | None, b: int) -> Zero:
    """The ZeRO settings the plan uses, DeepSpeed's defaults where absent (docs/memory-plan.md)."""
    ds = ds_config or {}
    z = ds.get("zero_optimization") or {}
    if z.get("stage", 3) not in (2, 3):
        raise ConfigError(f"train.deepspeed_config: the plan models ZeRO stages 3 and 2, got {z.get('stage')}")
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if accum is not None and accum not in _DTYPE_BYTES:
        raise ConfigError(f"train.deepspeed_config: unknown data_types.grad_accum_dtype {accum!r}")
    return Zero(
        int(z.get("stage", 3)),
        _DTYPE_BYTES[accum] if accum else b,
        int(z.get("reduce_bucket_size", 5e8)) if z.get("contiguous_gradients", True) else 0,
        int(z.get("stage3_max_live_parameters", 5e8 * 2)),
        int(z.get("sub_group_size", 1e9)),
    )


def phases(cfg: Config, world: int, gpu: int, arch: Arch, z: Zero, util: float, T: int):
    a, r, t = arch, cfg.rollout, cfg.train
    b = 4 if cfg.model.dtype == "float32" else 2  # "auto" is bf16 on a GPU
    tp, P, s = r.tensor_parallel_size, arch.params, math.ceil(arch.params / world)
    lora = cfg.model.lora
    # Trained parameters, one rank's partition: all of them, or with LoRA the adapters (the base frozen)
    trained = arch.lora_params(lora.rank, lora.target_modules) if lora.rank else P
    st = math.ceil(trained / world)
    lp, grad, master, moments, ipg = b * st, z.grad_bytes * st, (4 * st if b != 4 else 0), 8 * st, b * z.bucket
    whole = z.stage == 2  # ZeRO-2 (LoRA only): parameters whole on every rank; gradients and states partitioned
    if whole:
        s, lp = P, b * trained
    with_ref = cfg.loss.beta > 0 and not lora.rank  # LoRA's reference is the base with its adapters off
    ref = [Item("reference model partition (loss.beta > 0)", b * s)] if with_ref else []
    offload = t.offload_during_rollout is not False and not lora.rank  # LoRA: nothing moves (Policy)
    reserve = Item("reserve: CUDA context, NCCL, fragmentation (assumed)", RESERVE)
    # vLLM
    requested = math.ceil(util * gpu)
    tokens, seqs = (16384, 1024) if gpu >= 70 * GiB else (8192, 256)
    v_weights = b * math.ceil(P / tp)
    v_act = max(tokens * b * (3 * math.ceil(a.intermediate / tp) + 4 * a.hidden), seqs * a.vocab * 4 * 3)
    kv_bytes = requested - v_weights - v_act - VLLM_RUNTIME
    per_token = 2 * a.layers * math.ceil(a.kv_heads / tp) * a.head_dim * b
    seq_tokens = cfg.data.max_prompt_tokens + r.max_tokens
    per_seq = per_token * BLOCK * math.ceil(seq_tokens / BLOCK)
    kv = dict(
        kv_cache_bytes=kv_bytes,
        bytes_per_token=per_token,
        sequence_tokens=seq_tokens,
        sequence_bytes=per_seq,
        sequences_held=max(kv_bytes, 0) // per_seq,
        sequences_needed=math.ceil(t.rollout_batch_size / world) * tp * r.n,
        vllm_fixed=v_weights + v_act + VLLM_RUNTIME,
    )
    vllm = Item(f"vLLM: rollout.gpu_memory_utilization {util:g} x card", requested)
    trains = "adapter" if lora.rank else "param"
    gradients = Item(f"gradient partition ({z.grad_bytes} B/{trains} / {world})", grad)
    if lora.rank:
        share = ", whole: ZeRO-2" if whole else f" / {world}"  # the base stays in rollouts: nothing moves
        ddp = [
            Item(f"frozen base ({b} B/param{share})", b * s),
            Item(f"adapters ({trained / 1e6:.1f}M x {b} B{share})", lp),
            gradients,
        ]
    else:
        ddp = [Item(f"param partition ({b} B/param / {world})", lp), gradients]
    fp32 = [Item(f"fp32 master weights (4 B/{trains} / {world})", master)]
    adam = [Item(f"Adam moments (8 B/{trains} / {world})", moments)]
    bucket = [Item(f"IPG gradient bucket ({z.bucket:,} x {b} B)", ipg)]
    startup = ddp + fp32 + bucket + ref + [reserve, vllm]
    trainer = fp32 + adam + ddp + bucket
    # train.param_persistence (ZeRO-3): the whole model kept gathered from the first forward on, never offloaded
    persistent = t.param_persistence is True and not whole
    kept_whole = [Item(f"persistent parameters: the whole model kept gathered ({b} B/param)", b * P)] * persistent
    rollout = (
        ([replace(i, name=i.name + ": offloaded", counted=False) for i in trainer] if offload else trainer)
        + kept_whole
        + ref
        + [reserve, vllm]
    )
    rollout += [
        Item("  of which weights", v_weights, False),
        Item("  of which profile activations", v_act, False),
        Item("  of which non-torch, CUDA graphs (assumed)", VLLM_RUNTIME, False),
        Item("  of which KV cache", kv_bytes, False),
    ]
    # update
    gathered = 0 if whole or persistent else b * min(P, z.max_live + a.largest_module)
    layer = T * b * (LAYER_H * a.hidden + LAYER_KV * a.kv_heads * a.head_dim + LAYER_I * a.intermediate)
    layer += T * a.heads * 4  # sdpa's fp32 log-sum-exp
    if cfg.model.gradient_checkpointing:
        kept, layer_name = (a.layers + 1) * T * a.hidden * b, "backward: one layer recomputed"
    else:
        kept, layer, layer_name = 0, a.layers * layer, "backward: every layer's activations (no checkpointing)"
    head_grad = 0 if lora.rank else a.vocab * a.hidden * (4 + b)  # a frozen head has no weight gradient
    head = HEAD_CHUNKS * t.loss_chunk_tokens * a.vocab * 4 + head_grad + 2 * T * a.hidden * b
    backward = gathered + kept + max(layer, head)
    step = 4 * min(st, z.sub_group)
    update = ddp + fp32 + adam + bucket + kept_whole + ref
    update += [reserve, Item("vLLM asleep: non-torch, CUDA graphs", VLLM_RUNTIME)]
    update += [
        Item(f"backward: gathered params (max_live {z.max_live:,} + largest module)", gathered, backward >= step),
        Item(f"backward: checkpointed layer inputs ({a.layers} + 1 layers x {T} tokens)", kept, backward >= step),
        Item(layer_name, layer, backward >= step and layer >= head),
        Item(
            f"backward: LM head (chunks of {t.loss_chunk_tokens}{'' if lora.rank else ', [V, H] fp32 grad'})",
            head,
            backward >= step and head > layer,
        ),
        Item("optimizer step: flattened fp32 gradient", step, step > backward),
    ]
    if r.backend == "hf":
        startup = ddp + fp32 + bucket + ref + [reserve]
        batch = min(r.hf_max_batch, kv["sequences_needed"])
        held_rows, held_tokens, static, logits = batch, seq_tokens, "", 0
        if r.hf_decoding != "eager":  # on a GPU the static path holds a row bucket x whole cache spans
            from trapo.engine.static_decoding import SPAN, bucket

            held_rows, held_tokens = bucket(batch), -(-seq_tokens // SPAN) * SPAN
            static = f", static: {held_rows} rows x {held_tokens} positions"
            logits = held_rows * a.vocab * b  # the captured steps' one logits buffer, the turn long
        kv.update(kv_cache_bytes=held_rows * per_token * held_tokens, sequences_held=batch, vllm_fixed=0)
        prompt = cfg.data.max_prompt_tokens
        rows = min(batch, max(1, HF_PREFILL_TOKENS // prompt))
        prefill = rows * prompt * (b * (PREFILL_I * a.intermediate + PREFILL_H * a.hidden + 2 * a.head_dim) + prompt)
        sampler = 4 * batch * a.vocab * 4
        rollout = (
            trainer
            + kept_whole
            + ref
            + [
                reserve,
                Item(f"hf generation: the whole model gathered ({b} B/param)", 0 if whole or persistent else b * P),
                Item(
                    f"hf generation: KV cache ({batch} sequences x {seq_tokens} tokens{static})", kv["kv_cache_bytes"]
                ),
                Item(
                    f"hf generation: prefill activations ({rows} x {prompt} tokens a forward)",
                    prefill,
                    prefill >= sampler,
                ),
                Item(f"hf generation: sampler rows (4 fp32 [{batch}, V])", sampler, sampler > prefill),
                *([Item(f"hf generation: static steps' logits ({b} B x [{held_rows}, V])", logits)] if logits else []),
            ]
        )
        update = [i for i in update if not i.name.startswith("vLLM asleep")]
    return {"start-up": startup, "rollout": rollout, "update": update}, kv


def peak(items: list[Item]) -> int:
    return sum(i.bytes for i in items if i.counted)
