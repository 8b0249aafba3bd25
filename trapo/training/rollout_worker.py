"""A rollout rank's life under `rollout.placement: separate`: open the engine the trainer describes, then
answer its requests in order until it says stop.

    open      the engine settings, model directory, tokenizer and stop tokens of the run (training rank 0)
    weights   a version of the policy: received whole, checked (count, checksum), staged
    generate  the staged weights swapped in first (between requests only, never during one), then the
              rollouts, sent back labelled with the version that generated them
    stop      the run ended: the worker returns

The link (trapo/engine/rollout_link.py) bounds every wait by dist_timeout_minutes: a trainer that died
ends this process with one line too. Grading stays on the trainer (it is cheap beside generation here).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from trapo.config import Config
from trapo.engine.rollout_engine import open_engine
from trapo.engine.rollout_link import LinkError, RolloutLink
from trapo.training.preemption import StopSignals


def serve(cfg: Config, link_rank: int) -> None:
    """Run rollout rank `link_rank - 1` until the trainer says stop."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    link = RolloutLink(link_rank, cfg.rollout.ranks + 1, cfg.dist_timeout_minutes * 60)
    opening = link.recv(0, "the trainer's start-up")
    engine = open_engine(
        opening["settings"],
        opening["model_dir"],
        tokenizer=opening["tokenizer"],
        stop_token_ids=opening["stop_token_ids"],
    )
    link.send(dict(backend=opening["settings"].backend, device=engine.device(), effective_config=None), 0)
    linear = zero3_linear if opening["zero3_linear"] else contextlib.nullcontext
    # SIGTERM / SIGINT to the whole group (preemption, Ctrl-C): the trainer finishes its step and saves, which
    # waits for this rank's round in flight, so this rank serves on until the trainer's stop (a second: now)
    with StopSignals():
        _answer(link, engine, linear, link_rank)


def _answer(link: RolloutLink, engine, linear, link_rank: int) -> None:
    """The serving loop: one message at a time, in the order the trainer sent them."""
    version, staged = 0, None
    while True:
        message = link.recv(0, "its next request")
        if message["kind"] == "stop":
            link.flush()
            return
        if message["kind"] == "weights":
            staged = link.receive_weights(message)  # swapped in before the next request, not during one
            continue
        if message["kind"] != "generate":
            raise LinkError(f"rollout rank {link_rank - 1}: unknown message {message['kind']!r} from the trainer")
        if staged is not None:
            version = load_weights(engine, *staged)
            staged = None
        params = {k: message[k] for k in ("n", "temperature", "top_p", "max_tokens", "min_tokens")}
        started = time.perf_counter()
        with engine.turn(), linear():
            rollouts = engine.generate(message["prompts"], seeds=message["seeds"], **params)
        seconds = time.perf_counter() - started
        link.send(dict(key=message["key"], version=version, rollouts=rollouts, generate_s=seconds), 0)


def load_weights(engine, version: int, weights: dict[str, torch.Tensor]) -> int:
    """The staged weights into the engine's model (hf: its parameters, in place); their version."""
    params = dict(engine.model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unknown = sorted(set(weights) - set(params))
    if missing or unknown:
        raise LinkError(f"weights {version} do not fit the rollout model: missing {missing[:3]}, unknown {unknown[:3]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    return version


@contextlib.contextmanager
def zero3_linear():
    """torch.nn.functional.linear computed as ZeRO-3's replacement computes it on the training ranks
    (addmm with a bias on 2-D inputs, matmul then add elsewhere), so that this plain model's logits are
    bit-equal to those of the colocated engine, which generates with the policy under ZeRO-3."""
    import torch.nn.functional as F

    from trapo.engine.dist import import_deepspeed

    LinearFunctionForZeroStage3 = import_deepspeed().runtime.zero.linear.LinearFunctionForZeroStage3

    plain = F.linear
    F.linear = LinearFunctionForZeroStage3.forward
    try:
        yield
    finally:
        F.linear = plain
