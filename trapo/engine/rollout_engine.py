"""The rollout engine: what the trainer and `trapo eval` call on either backend (`RolloutEngine`), and the one
factory that opens it by backend (`open_engine`; trapo/engine/rollout.py lists the backends).

The backends (trapo/engine/vllm_rollout.py `VllmEngine`, trapo/engine/hf_rollout.py `HfEngine`) implement the
protocol without importing it, so this module may import them, lazily: vLLM stays unimported with backend hf.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from trapo.engine.rollout import Rollout

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RolloutEngine(Protocol):
    """One rank's generator of rollouts, whichever backend: prompts in as token ids, `Rollout`s out."""

    # True while the engine holds no weights (vLLM's level-2 sleep after a turn): push_weights before generating
    weights_asleep: bool

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        max_tokens: int,
        seeds: list[int] | None = None,
        min_tokens: int = 0,
    ) -> list[list[Rollout]]:
        """n samples per prompt, [len(prompts)][n]. With `seeds` (one per prompt, `rollout.request_seed`) a
        sample depends on its seed and the weights only, so a resumed run draws the same rollouts. No stop
        token is drawn before `min_tokens` tokens (its probability is 0 there, as in vLLM)."""
        ...

    def turn(self) -> AbstractContextManager:
        """A stretch of generation (a round's rollouts, an evaluation); what the backend holds only while it
        generates is taken on entry and let go on exit. Generating outside a turn works, one call at a time."""
        ...

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The policy's weights (Hugging Face names, possibly gathered lazily) into the engine after an update;
        the bytes loaded. 0 and the iterator left unread when the engine generates with the policy itself."""
        ...

    def effective_config(self) -> dict | None:
        """What the engine's own model runs (rope_theta, max_position_embeddings, vocab_size, dtype), compared
        with `Policy.effective_config` at start-up; None when it generates with the policy's model itself."""
        ...

    def device(self) -> str:
        """Where the engine's weights sit, e.g. "cuda:3" or "cpu"."""
        ...

    def describe(self, devices: list[str]) -> str:
        """The start-up line naming every rank's engine and its device (`devices`, in rank order)."""
        ...


@dataclass(frozen=True)
class EngineSettings:
    """What `open_engine` builds, from a training run's config (`trapo.training.settings.engine_settings`) or
    `trapo eval`'s flags."""

    backend: str  # rollout.backend / --backend
    dtype: str  # the weights' dtype: model.dtype / --dtype
    max_model_len: int  # the longest prompt + response served (vLLM sizes its KV cache by it)
    seed: int  # vLLM's engine seed (every request carries its own)
    overrides: dict = field(default_factory=dict)  # config attributes over the checkpoint's (policy.model_overrides)
    hf_max_batch: int = 256  # hf: sequences generated at once
    hf_decoding: str = "auto"  # hf: how a decode step runs (rollout.hf_decoding)
    vllm: dict = field(default_factory=dict)  # VllmEngine's sizing, where not its defaults (training's rollout.*)


def open_engine(
    settings: EngineSettings, model_dir: str, *, tokenizer, stop_token_ids: list[int], policy=None
) -> RolloutEngine:
    """This rank's rollout engine on `model_dir`, by `settings.backend`.

    `policy`: a training run's `Policy`, whose own model the hf engine then generates with (its ZeRO-3
    parameters gathered once per turn); without one (`trapo eval`) the hf engine loads `model_dir` itself.
    The vLLM engine always loads its own copy of `model_dir`, the policy's weights pushed into it later.
    """
    s = settings
    if s.backend not in ("vllm", "hf"):  # auto is chosen before an engine opens (run_record.resolve_backend, eval)
        raise ValueError(f"open_engine: backend {s.backend!r} is not an engine; choose it first (choose_backend)")
    if s.backend == "hf":
        from trapo.engine.hf_rollout import HfEngine

        if policy is not None:
            return HfEngine(
                policy.model,
                tokenizer,
                stop_token_ids=stop_token_ids,
                max_batch=s.hf_max_batch,
                zero3_engine=policy.engine,
                decoding=s.hf_decoding,
            )
        return HfEngine.from_pretrained(
            model_dir,
            tokenizer,
            dtype=s.dtype,
            stop_token_ids=stop_token_ids,
            max_batch=s.hf_max_batch,
            overrides=s.overrides,
            decoding=s.hf_decoding,
        )
    from trapo.engine.vllm_rollout import VllmEngine
    from trapo.runtime import dtype_name

    return VllmEngine(
        model_dir,
        tokenizer=tokenizer,
        dtype=dtype_name(s.dtype),
        max_model_len=s.max_model_len,
        seed=s.seed,
        hf_overrides=s.overrides,
        stop_token_ids=stop_token_ids,
        **s.vllm,
    )
