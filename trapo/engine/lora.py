"""LoRA adapters on the policy (`model.lora.rank > 0`), through peft.

    model = attach(model, cfg.model.lora)          # frozen base + adapters B A (B = 0: the base's outputs)
    for name, tensor in merged(gathered_parameters(model), scalings(model)):
        ...                                          # Hugging Face names, W + (alpha / r) B A: what vLLM and hf/ take

How the pieces fit the rest of the engine (the choices and their figures: docs/gpus.md, "LoRA"):
- The base stays in the model's dtype, frozen, partitioned by ZeRO-3 like a full model; the adapters are
  the only parameters the optimizer holds (fp32 master weights and Adam moments for them alone).
- Rollouts see the adapted policy through merged copies: each linear layer's W + (alpha / r) B A is
  computed while its block is gathered for the push, in fp32, and the base is never written. (peft's
  merge-then-unmerge would add and subtract the update in the base's own dtype every step: in bf16 that
  rounding drifts the frozen base.)
- The KL reference (loss.beta > 0) is the same model with its adapters disabled, never a second copy.
- A checkpoint holds the adapters and their optimizer state; the base is named by `base_identity` (its
  path and the SHA-256 of its weight files), so a resume onto another base stops with both named.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from trapo.config import ConfigError, LoraConfig

PEFT_PREFIX = "base_model.model."  # peft's wrapper: PeftModel.base_model (LoraModel).model (the HF model)
ADAPTER = "default"  # peft's name for the one adapter we attach
# trapo/algorithm/logits.py applies the LM head's weight itself, chunk by chunk: an adapter on it would be skipped.
UNADAPTABLE = {
    "lm_head": "the LM head is applied by trapo's chunked head (trapo/algorithm/logits.py), which reads "
    "its weight directly"
}


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (q_proj, ..., lm_head): what target_modules takes."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """ConfigError (one line) naming each target that is not a linear layer's name in this model, with the
    names it has. A target is a module's last name, or a dotted suffix of its full name (peft's rule)."""
    full = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in targets:
        if target in UNADAPTABLE:
            raise ConfigError(f"model.lora.target_modules: {target!r} cannot take an adapter: {UNADAPTABLE[target]}")
        if not any(name == target or name.endswith("." + target) for name in full):
            names = [n for n in linear_names(model) if n not in UNADAPTABLE]
            raise ConfigError(
                f"model.lora.target_modules: {target!r} is not a linear layer of this model; its linear layers "
                f"are {', '.join(names)}"
            )


def check_config_targets(hf_config, targets: list[str]) -> None:
    """`check_targets` before any weight is read: on the model's architecture built from its config alone,
    on the meta device (no memory, no weight file opened; a second at 7B). Call it before DeepSpeed's
    zero.Init is on (HfDeepSpeedConfig), which would partition even an empty model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    check_targets(skeleton, targets)


def attach(model: torch.nn.Module, lora: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """The model wrapped by peft with fresh adapters on `lora.target_modules`, every base parameter frozen.

    A is drawn (peft: Kaiming-uniform) from the RNG seeded with `seed`, the run's: every rank draws the same
    adapters, and a run started again draws them again (the trainer seeds no global RNG). B starts at zero,
    so before the first update the outputs equal the base model's.

    The adapters take the base's dtype (`autocast_adapter_dtype=False`: peft would otherwise keep them in
    fp32 beside a bf16 base): the optimizer's fp32 master copy of them is where precision is kept, as for a
    full model."""
    import peft

    check_targets(model, lora.target_modules)
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


def describe(model: torch.nn.Module, lora: LoraConfig) -> str:
    """One line for the log: what trains and what stays frozen. (ZeRO-3 parameters count by `ds_numel`.)"""
    trained = frozen = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        trained, frozen = (trained + n, frozen) if p.requires_grad else (trained, frozen + n)
    return (
        f"model.lora: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}: {trained:,} "
        f"trainable parameters ({100 * trained / (trained + frozen):.2f}%), the base's {frozen:,} frozen"
    )


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """{Hugging Face module name: alpha / r} for every adapted layer of a peft model."""
    out = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling:
            out[hf_name(name)] = float(scaling[ADAPTER])
    return out


def hf_name(name: str) -> str:
    """A peft parameter or module name as the base model names it: prefix off, `.base_layer` dropped."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A for a linear layer: weight [out, in], a [r, in], b [out, r]; computed in fp32 and
    returned in the weight's dtype (peft's `get_delta_weight` for nn.Linear, without the in-place add)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


_PART = re.compile(rf"^(?P<module>.+)\.(?:base_layer\.weight|lora_(?P<ab>[AB])\.{ADAPTER}\.weight)$")


def merged(named: Iterable[tuple[str, torch.Tensor]], scale: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named full tensors of the adapted model, each adapted layer's weight merged.

    named: (peft name, full tensor) in module order, e.g. `dist.gathered_parameters(model)`; scale:
    `scalings(model)`. A layer's base weight and its A and B come in the same block, so at most one
    block's parts wait here. Every other tensor (biases, norms, embeddings, the head) passes through renamed.
    """
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        match = _PART.match(name.removeprefix(PEFT_PREFIX))
        module = match and hf_name(match["module"])
        if module not in scale:
            yield hf_name(name), tensor
            continue
        parts = waiting.setdefault(module, {})
        parts[match["ab"] or "W"] = tensor
        if len(parts) == 3:
            del waiting[module]
            yield f"{module}.weight", merge_weight(parts["W"], parts["A"], parts["B"], scale[module])
    if waiting:  # a layer whose parts never all came: the push or hf/ would lack its weight
        raise RuntimeError(f"LoRA merge: incomplete layers {sorted(waiting)[:3]} (parts {list(waiting.values())[0]})")


# ----------------------------------------------------------------------------- the base's identity


def _file_sha256(path: Path) -> str:
    """A weight file's SHA-256. A hub snapshot's file links to its blob, which the hub names by that very
    digest (for LFS files): read from the link, not recomputed; any other file is hashed in 16 MiB reads."""
    target = path.resolve().name
    if path.is_symlink() and re.fullmatch(r"[0-9a-f]{64}", target):
        return target
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def base_identity(model_dir: str) -> dict:
    """{"path", "sha256"}: the base model's directory and one digest over its weight files (by name).
    A LoRA checkpoint keeps it: its adapters mean nothing on another base."""
    files = sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("*.bin"))
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}:{_file_sha256(file)}\n".encode())
    return {"path": str(model_dir), "sha256": digest.hexdigest()}


def base_problem(saved: dict | None, now: dict | None) -> str | None:
    """Why a checkpoint's adapters cannot resume on this base (None: they can)."""
    if saved is None and now is None:
        return None
    if saved is None or now is None:
        had, has = ("full fine-tuning", "LoRA") if saved is None else ("LoRA", "full fine-tuning")
        return f"the checkpoint was saved by a {had} run and this run trains with {has} (model.lora.rank)"
    if saved["sha256"] != now["sha256"]:
        return (
            f"the checkpoint's adapters were trained on the base {saved['path']} (weights sha256 "
            f"{saved['sha256'][:16]}), and model.path is now {now['path']} (sha256 {now['sha256'][:16]}): "
            f"resume with model.path={saved['path']}, or start a new run"
        )
    return None
