"""What both rollout backends share: the `Rollout` record, per-request seeds, one decode per round, and the
choice of backend (`rollout.backend`).

- vllm: a colocated `vllm.LLM` per rank (trapo/engine/vllm_rollout.py); weights pushed after each update.
- hf:   the policy's own transformers model generates (trapo/engine/hf_rollout.py); nothing to push.

Both take prompts as token ids and return token ids; the text grading reads is decoded here, once for all
of a `generate` call's responses (`decode_responses`), not token by token inside the engine.
trapo/engine/rollout_engine.py opens the one a run's config names.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass

from trapo.config import ConfigError

BACKENDS = ("vllm", "hf")


@dataclass
class Rollout:
    token_ids: list[int]  # sampled tokens, the stop token included when generation stopped on one
    text: str  # the stop token's text excluded
    truncated: bool  # hit max_tokens
    logprobs: list[float] | None = None  # per sampled token, of the distribution it was sampled from


def request_seed(*parts) -> int:
    """A sampling seed for one request from its identity, e.g. (run seed, step, question index).

    It depends on nothing else (not batch order, not rank), so a resumed run or
    a repeated evaluation draws the same samples.
    """
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def decode_responses(tokenizer, responses: list[list[int]], stop_token_ids: list[int]) -> list[str]:
    """The text of each response, decoded in one `batch_decode`: a final stop token is left out (the
    Rollout's text excludes it) and special tokens are skipped, as vLLM's detokenizer does."""
    stops = set(stop_token_ids)
    bodies = [ids[:-1] if ids and ids[-1] in stops else ids for ids in responses]
    return tokenizer.batch_decode(bodies, skip_special_tokens=True)


def installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (vLLM's import takes seconds)."""
    if package in sys.modules:
        return sys.modules[package] is not None  # None: import blocked (as the tests block vLLM)
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require_backend(backend: str, key: str = "rollout.backend", fix: str = "rollout.backend=hf") -> None:
    """Stop before any work when `backend` cannot run here; the message names the setting (`key`) and `fix`."""
    if backend not in BACKENDS:
        raise ConfigError(f"{key}: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "vllm" and not installed("vllm"):
        raise ConfigError(
            f"{key}: vllm is not installed in this environment; install it (make setup) or set "
            f"{fix} to generate with the policy's own transformers model"
        )
