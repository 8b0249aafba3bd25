"""What both rollout backends share: the `Rollout` record, per-request seeds, one decode per round, and the
choice of backend (`rollout.backend`).

- vllm: a colocated `vllm.LLM` per rank (trapo/engine/vllm_rollout.py); weights pushed after each update.
- hf:   the policy's own transformers model generates (trapo/engine/hf_rollout.py); nothing to push.
- auto: vllm where it is installed, else hf (`choose_backend`), decided once at start-up.

Both take prompts as token ids and return token ids; the text grading reads is decoded here, once for all
of a `generate` call's responses (`decode_responses`), not token by token inside the engine.
trapo/engine/rollout_engine.py declares what both implement (`RolloutEngine`) and opens either (`open_engine`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass

from trapo.config import BACKENDS, ConfigError


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


# vLLM 0.32's rule for the longest sequence an engine may serve (transformers_utils/
# model_arch_config_convertor.py `derive_max_model_len_and_key`, config/model.py `_get_and_verify_max_len`): the
# smallest of these config.json keys, times the RoPE scaling factor unless its type extends the context
# itself; vLLM refuses a longer max_model_len (VLLM_ALLOW_LONG_MAX_MODEL_LEN aside, under which RoPE positions
# past it give NaN). The hf backend gets the same limit: past it the positions are out of the model's training.
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_limit(model_dir, max_position_embeddings: int | None = None) -> tuple[int, str] | None:
    """(the longest prompt + response the model serves, the config.json key it comes from), or None when
    its config.json names none. `max_position_embeddings` is the run's override (model.max_position_embeddings)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loaders say what is wrong with it
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    if max_position_embeddings is not None:
        config = {**config, "max_position_embeddings": max_position_embeddings}
    found = [(int(config[k]), k) for k in CONTEXT_KEYS if isinstance(config.get(k), int | float)]
    if not found:
        return None
    length, key = min(found)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if (
        isinstance(rope, dict)
        and rope.get("factor")
        and (rope.get("rope_type") or rope.get("type")) not in UNSCALED_ROPE
    ):
        length, key = int(length * rope["factor"]), f"{key} x rope_scaling.factor"
    return length, key


def installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (vLLM's import takes seconds)."""
    if package in sys.modules:
        return sys.modules[package] is not None  # None: import blocked (as the tests block vLLM)
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def choose_backend(requested: str, recorded: str | None = None) -> tuple[str, str]:
    """(backend, why) for `requested`: itself unless it is "auto"; for auto the run's `recorded` backend (a
    resume keeps the engine it started with), else vllm when it is installed, else hf, with either rollout
    placement. `why` is the start-up line's reason (empty for a backend named outright)."""
    if requested != "auto":
        return requested, ""
    if recorded in BACKENDS and recorded != "auto":
        return recorded, "as this run started (its config.yaml); resume_changes=[rollout.backend] chooses again"
    if installed("vllm"):
        return "vllm", "vLLM is installed"
    return "hf", "vLLM is not installed: the policy's own transformers model generates (pip install trapo[gpu])"


def require_backend(
    backend: str, key: str = "rollout.backend", fix: str = "rollout.backend=hf", *, load: bool = True
) -> None:
    """Stop before any work when `backend` cannot run here; the message names the setting (`key`) and `fix`.

    For vllm: not installed, or, with `load`, installed but failing to import (a torch build it was not
    made for, a missing CUDA library: whatever the import raises). Either is a ConfigError of one line; a
    failed import's line carries the import error's own message, and the error is its cause (the traceback
    in the log). `load` imports what the engine uses, which takes seconds: the trainer and `trapo eval` check
    with load=False first and load after their input checks, before the model loads (input errors stay quick,
    vLLM's import-time logging goes to log.txt); the doctor loads at its first check.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"{key}: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    backend = choose_backend(backend)[0]
    if backend != "vllm":
        return
    instead = f"{fix} to generate with the policy's own transformers model"
    if not installed("vllm"):
        raise ConfigError(f"{key}: vllm is not installed in this environment; install it (make setup) or set {instead}")
    if not load:
        return
    try:
        from vllm import LLM, SamplingParams  # noqa: F401 - the engine's imports (trapo/engine/vllm_rollout.py)
        from vllm.inputs import TokensPrompt  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure inside the import is the install's
        lines = [line for line in str(err).splitlines() if line.strip()]
        what = f"{type(err).__name__}: {lines[0].strip()}" if lines else type(err).__name__
        raise ConfigError(
            f"{key}: vllm is installed but fails to import ({what}); reinstall it to match this torch and CUDA "
            f"(make clean-venv setup) or set {instead}"
        ) from err
