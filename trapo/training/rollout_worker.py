"""A rollout rank's life under `rollout.placement: separate`: open the engine the trainer describes, then
answer its requests in order until it says stop.

    open      the engine settings, model directory, tokenizer and stop tokens of the run (training rank 0)
    weights   a version of the policy, loaded into the engine bucket by bucket as it arrives, each bucket
              checked first (checksum; the count at the last): messages are taken one at a time, so a new
              version comes in between requests, never during one
    generate  the rollouts, sent back labelled with the version that generated them
    stop      the run ended: the worker returns

The engine is either backend's, opened as `open_engine` opens it. vLLM builds its engine through its external
launcher, as the colocated engine does, in a torch.distributed world of this process alone (`own_world`).

The link (trapo/engine/rollout_link.py) bounds every wait by dist_timeout_minutes: a trainer that died
ends this process with one line too. Grading stays on the trainer (it is cheap beside generation here).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

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
    settings = opening["settings"]
    if settings.backend == "vllm":
        own_world()
    engine = open_engine(
        settings,
        opening["model_dir"],
        tokenizer=opening["tokenizer"],
        stop_token_ids=opening["stop_token_ids"],
    )
    link.send(dict(backend=settings.backend, device=engine.device(), effective_config=engine.effective_config()), 0)
    # hf: computed as ZeRO-3 computes the policy's linear layers; vLLM runs its own kernels, as colocated
    zero3 = opening["zero3_linear"] and settings.backend == "hf"
    linear = zero3_linear if zero3 else contextlib.nullcontext
    # SIGTERM / SIGINT to the whole group (preemption, Ctrl-C): the trainer finishes its step and saves, which
    # waits for this rank's round in flight, so this rank serves on until the trainer's stop (a second: now)
    with StopSignals():
        _answer(link, engine, linear, link_rank)


def own_world() -> None:
    """A torch.distributed world of this process alone, for a vLLM engine: vLLM's external launcher (the
    executor the colocated engines use) then builds it on this rank's device, cuda:LOCAL_RANK. vLLM 0.32's
    default executor (v1/executor/uniproc_executor.py) would start a world of its own too, but on the device
    index of an explicit `device` only, else cuda:0: training rank 0's GPU. The link keeps its own gloo group
    and store (rollout_link.py), apart from this world."""
    import torch.distributed as tdist

    folder = tempfile.mkdtemp(prefix="trapo-rollout-world-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ.update(RANK="0", WORLD_SIZE="1")  # what the external launcher reads: rank 0 of this world
    store = tdist.FileStore(os.path.join(folder, "store"), 1)
    tdist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=0, world_size=1)


def _answer(link: RolloutLink, engine, linear, link_rank: int) -> None:
    """The serving loop: one message at a time, in the order the trainer sent them."""
    version = 0
    while True:
        message = link.recv(0, "its next request")
        if message["kind"] == "stop":
            link.flush()
            return
        if message["kind"] == "weights":
            version = message["version"]
            load_weights(engine, link.receive_weights(message), version)
            continue
        if message["kind"] != "generate":
            raise LinkError(f"rollout rank {link_rank - 1}: unknown message {message['kind']!r} from the trainer")
        params = {k: message[k] for k in ("n", "temperature", "top_p", "max_tokens", "min_tokens")}
        started = time.perf_counter()
        with engine.turn(), linear():
            rollouts = engine.generate(message["prompts"], seeds=message["seeds"], **params)
        seconds = time.perf_counter() - started
        link.send(dict(key=message["key"], version=version, rollouts=rollouts, generate_s=seconds), 0)


def load_weights(engine, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
    """Version `version`'s (name, tensor) pairs into the engine as they come: vLLM's own push (which checks
    that every engine parameter received its tensors), or the hf model's parameters, in place."""
    model = getattr(engine, "model", None)  # the hf engine's model; vLLM's sits behind its executor
    if model is None:
        engine.push_weights(weights)
        return
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                raise LinkError(f"weights {version} do not fit the rollout model: unknown {name!r}")
            params[name].copy_(tensor)
            seen.add(name)
    if missing := sorted(set(params) - seen):
        raise LinkError(f"weights {version} do not fit the rollout model: missing {missing[:3]}")


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
