"""The colocated vLLM engine: one `vllm.LLM` in the trainer process per rank.

Rollouts go in as token ids (no re-tokenisation) and come out as token ids
and text. After each update the trainer streams the policy's weights into the
engine with `push_weights`: vLLM's in-place `reload_weights` consumes an
iterator, so a generator that gathers one ZeRO-3 module at a time keeps peak
extra memory at one layer. On GPU the engine sleeps while the policy trains.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Rollout:
    token_ids: list[int]  # sampled tokens, EOS included when generation stopped on it
    text: str
    truncated: bool  # hit max_tokens


def request_seed(*parts) -> int:
    """A sampling seed for one request from its identity, e.g. (run seed, step, question index).

    It depends on nothing else (not batch order, not rank), so a resumed run or
    a repeated evaluation draws the same samples.
    """
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class RolloutEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str,
        max_model_len: int,
        seed: int,
        gpu_memory_utilization: float = 0.4,
        cpu_kv_cache_gb: float = 0.25,
        enable_sleep_mode: bool = True,
        enable_prefix_caching: bool = True,
        hf_overrides: dict | None = None,
    ):
        # The process environment (an in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0) is set
        # by the entry point, see trapo/runtime.py.
        import torch
        from vllm import LLM

        self.on_gpu = torch.cuda.is_available()
        kwargs = dict(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
        )
        if hf_overrides:
            kwargs["hf_overrides"] = hf_overrides  # e.g. rope_theta, as the policy uses
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        else:
            # The CPU backend sizes its KV cache from this, not from a memory fraction;
            # CUDA graphs / compilation do not apply.
            kwargs.update(kv_cache_memory_bytes=int(cpu_kv_cache_gb * 2**30), enforce_eager=True)
            # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill,
            # which CPU generators cannot do ("CPU Generator does not use offset"): prefill whole prompts.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
        # vLLM's in-process engine seeds the global RNGs; keep the trainer's streams untouched.
        with torch.random.fork_rng(devices=[]):
            self.llm = LLM(**kwargs)
        self.sleeping = False
        self.sleep_enabled = self.on_gpu and enable_sleep_mode

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        max_tokens: int,
        seeds: list[int] | None = None,
    ) -> list[list[Rollout]]:
        """n samples per prompt. With `seeds` (one per prompt) sampling depends
        only on the seed and the weights, not on batch composition, so a resumed
        run draws the same rollouts. Returns [len(prompts)][n]."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                seed=None if seeds is None else seeds[i],
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )  # one RequestOutput per prompt, in order
        return [
            [Rollout(list(c.token_ids), c.text, c.finish_reason == "length") for c in out.outputs] for out in outputs
        ]

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, float]:
        """Load Hugging Face-named tensors into the engine in place.

        Returns (bytes pushed, seconds). The iterator may gather lazily; vLLM
        fuses q/k/v and gate/up itself (`is_checkpoint_format=True`).
        """
        self.wake_up()
        pushed = [0]

        def counted():
            for name, tensor in named_tensors:
                pushed[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=counted(), is_checkpoint_format=True))
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        return pushed[0], time.perf_counter() - start

    def sleep(self) -> None:
        """GPU: release weights and KV cache while the policy trains (level 1 keeps weights in host memory)."""
        if self.sleep_enabled and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
