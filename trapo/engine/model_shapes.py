"""A model's shapes as the memory plan counts them (widths, layers, heads, vocabulary; its parameters and LoRA
adapters from those), read from the model directory's config.json or, where that directory is absent, from the
built-in table of the paper's models. Reads one file; imports no torch.

    arch = model_arch("models/Qwen2.5-Math-7B")   # config.json there, else BUILTIN["Qwen2.5-Math-7B"]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trapo.config import ConfigError


@dataclass(frozen=True)
class Arch:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    source: str = "built-in table"

    @property
    def params(self) -> int:
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if self.qkv_bias else 0)
        layer = attention + 3 * h * self.intermediate + 2 * h  # + MLP gate/up/down + two RMSNorms
        return self.layers * layer + self.vocab * h * (1 if self.tied else 2) + h  # + embeddings, head, norm

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: rank x (in + out) for each targeted linear layer of every layer (A [r, in],
        B [out, r]); a target is the layer's last name (q_proj ... down_proj)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in shapes]
        if unknown:
            raise ConfigError(
                f"model.lora.target_modules: the plan knows {', '.join(shapes)}, not {', '.join(unknown)}"
            )
        return self.layers * sum(rank * sum(shapes[t.rsplit(".", 1)[-1]]) for t in set(targets))

    @property
    def largest_module(self) -> int:  # DeepSpeed's `model_to_params`: one module's own parameters
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


# Public config.json values (Hugging Face). R1-Distill-Qwen-1.5B is untied: 1.78e9 parameters need a separate head.
BUILTIN = {
    a.name: a
    for a in (
        Arch("Qwen2.5-Math-7B", 3584, 28, 28, 4, 128, 18944, 152064, qkv_bias=True),
        Arch("DeepSeek-R1-Distill-Qwen-1.5B", 1536, 28, 12, 2, 128, 8960, 151936, qkv_bias=True),
        Arch("Llama-3.1-8B-Instruct", 4096, 32, 32, 8, 128, 14336, 128256),
        # configs/real_smollm2.yaml's, before `trapo get-model` has written its directory (tied, as SmolLM2 is)
        Arch("SmolLM2-135M-Instruct", 576, 30, 9, 3, 64, 1536, 49152, tied=True),
    )
}


def model_arch(model_path: str) -> Arch:
    """The architecture from `model_path`/config.json; without the directory, the built-in table by its name."""
    if not model_path:
        raise ConfigError("model.path is empty (toy.enabled builds its own model): the plan needs a model directory")
    path = Path(model_path)
    config = path / "config.json"
    if config.is_file():
        try:
            c = json.loads(config.read_text())
            heads = c["num_attention_heads"]
            h, kv = c["hidden_size"], c.get("num_key_value_heads") or heads
            dims = (h, c["num_hidden_layers"], heads, kv, c.get("head_dim") or h // heads, c["intermediate_size"])
            tied = bool(c.get("tie_word_embeddings", False))  # Qwen2's and Llama's default
            bias = bool(c.get("attention_bias", c.get("model_type") == "qwen2"))  # Qwen2: q/k/v biases
            return Arch(path.name, *dims, c["vocab_size"], tied=tied, qkv_bias=bias, source=str(config))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                f"model.path {model_path}: cannot read the architecture from config.json ({err!r})"
            ) from None
    if not path.exists() and path.name in BUILTIN:
        return BUILTIN[path.name]
    if path.is_dir():
        raise ConfigError(f"model.path {model_path}: no config.json in that directory to read the architecture from")
    raise ConfigError(
        f"model.path {model_path!r}: no {config} to read the architecture from, and {path.name!r} is not in "
        f"the built-in table ({', '.join(BUILTIN)})"
    )
