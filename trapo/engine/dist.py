"""Distributed helpers: the process group, small collectives, ZeRO-3 parameter gathering.

Every function here is collective unless it says otherwise: all ranks call it
in the same order. A plain `python` process gets a one-process world, so the
same code runs with and without a launcher; a process that never initialised
the group (a unit test, a tool) acts as a world of one in `barrier`,
`all_gather` and `all_max`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


def import_deepspeed():
    """`import deepspeed`, without the MLflow import its autotuner tries at import time.

    DeepSpeed imports `mlflow` whenever it is installed (it is, for `logging.mlflow`): seconds of every
    process's start-up (docs/upstream-notes.md), for an autotuner we never run. The module is hidden only
    while DeepSpeed imports; our MLflow logger imports it as usual later."""
    import sys

    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner's has_mlflow = False
        try:
            import deepspeed
        finally:
            del sys.modules["mlflow"]
    import deepspeed

    return deepspeed


def free_port() -> int:
    """A local TCP port no one listens on now (for a process group's or a launcher's master port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: float | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank), initialising the process group once (nccl on GPU, gloo on CPU).

    timeout_minutes: how long any collective waits for the other ranks before it raises (see
    `timeout_message`); None keeps torch's default."""
    import datetime

    deepspeed = import_deepspeed()

    if "RANK" not in os.environ:
        port = str(free_port())
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        # DeepSpeed would JIT-compile a shared-memory op (about a minute) that gloo does not need.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        timeout = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", **timeout)
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def timeout_message(err: BaseException, timeout_minutes: float) -> str | None:
    """The one line for a collective that timed out (torch raises a RuntimeError, or its DistBackendError
    subclass, whose text says so), or None for any other error."""
    text = str(err).lower()
    if not isinstance(err, RuntimeError) or not ("timed out" in text or "timeout" in text):
        return None
    return (
        f"a collective waited longer than dist_timeout_minutes={timeout_minutes:g}: another rank died or hangs "
        "(see its log.rank-R.txt); run again with resume_from=latest, or raise dist_timeout_minutes if a rank "
        "was only slow"
    )


def comm_device() -> torch.device:
    """Where collective tensors live: this rank's GPU under nccl, the CPU under gloo (not collective)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rank() -> int:
    """This process's rank (0 outside a process group; not collective)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather(obj, group=None):
    """Every rank's `obj` (of `group`, default the world), in rank order (small picklable objects only)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@dataclass(frozen=True)
class RankGroup:
    handle: object  # the torch.distributed process group
    rank: int  # this rank's position in the group
    size: int
    index: int  # which group: rank // size


def tensor_parallel_group(size: int) -> RankGroup:
    """This rank's group of `size` consecutive ranks ([0..k-1], [k..2k-1], ...), as vLLM's
    external_launcher forms its tensor-parallel groups. Every rank creates every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"rollout.tensor_parallel_size ({size}) must divide the world size ({world})")
    if size == 1:
        return RankGroup(None, 0, 1, rank)
    mine = None
    for start in range(0, world, size):
        handle = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = RankGroup(handle, rank - start, size, rank // size)
    return mine


def once_per_node(work):
    """`work(cached_only)` once per node first: local rank 0 runs `work(False)` (a download, say) while the
    node's other ranks wait, then they run `work(True)` (reading what it left). An error on any rank stops
    every rank with that error, instead of leaving the others waiting."""
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    result, error = None, None
    for turn in ("leaders", "others"):
        if leader == (turn == "leaders"):
            try:
                result = work(turn == "others")
            except Exception as err:  # noqa: BLE001 - carried to every rank below, then raised
                error = err
        raise_any(error)  # also the barrier between the two turns
    return result


def on_rank0(work):
    """`work()` on rank 0 alone, while the others wait; an error there stops every rank with it."""
    result, error = None, None
    if rank() == 0:
        try:
            result = work()
        except Exception as err:  # noqa: BLE001 - carried to every rank, then raised
            error = err
    raise_any(error)
    return result


def raise_any(error: BaseException | None) -> None:
    """Collective: when any rank passes an error, every rank raises (its own, else the first rank's)."""
    failed = [e for e in all_gather(error) if e is not None]
    if failed:
        raise error or failed[0]


def all_max(value: int) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """Sum of each named value over all ranks (one all-reduce in float64; every rank passes the same keys)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    return dict(zip(values, t.tolist()))


def parameter_blocks(named_params: Iterable) -> Iterator[list]:
    """Group consecutive (name, param) pairs by block: 'model.layers.3.mlp.up_proj.weight' -> 'model.layers.3'.

    A block is a repeated layer or, outside the layer stack, one module (not collective).
    """
    group, key = [], None
    for name, p in named_params:
        parts = name.split(".")
        digit = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        k = ".".join(parts[: digit + 1]) if digit is not None else ".".join(parts[:-1])
        if group and k != key:
            yield group
            group = []
        group.append((name, p))
        key = k
    if group:
        yield group


def gathered_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter of a ZeRO-3 model, gathered one block at a time.

    One collective gather per block keeps the peak extra memory at one layer
    while making far fewer calls than gathering parameter by parameter. Every
    rank must consume the whole iterator.
    """
    import deepspeed

    for params in parameter_blocks(model.named_parameters()):
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            for name, p in params:
                # A copy: the gathered buffer is freed when the context exits,
                # and vLLM may keep a tensor until its fused partner arrives.
                yield name, p.data.detach().clone()


@contextlib.contextmanager
def gathered_for_generation(engine):
    """Every parameter of a ZeRO-3 DeepSpeed `engine`'s module whole on every rank for a stretch of forwards
    (generation), gathered once on entry and partitioned again on exit. Collective; nothing below ZeRO-3.

    ZeRO-3's module hooks would release each layer after its forward and gather it again for the next
    token, so they are taken off meanwhile and registered again after, also after an error (as DeepSpeed's
    `unwrap_model_for_generation` does). The root module's start-of-forward hook goes too, which DeepSpeed's
    function leaves: its collectives would make ranks doing different numbers of generation forwards (an
    evaluation shard with no questions, a batch whose samples all stop at the first token) wait for each
    other. Registering the hooks again makes the next training forward record the module order anew, on
    every rank alike. The DeepSpeed source lines: docs/upstream-notes.md.
    """
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None or not engine.zero_optimization_partition_weights():
        yield
        return
    module = offload.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        start_of_forward = module._forward_pre_hooks[offload.fwd_pre_hook.id]  # reset_step (setup_zero_stage3_hooks)
        offload._remove_module_hooks()  # DeepSpeed's own teardown: module hooks and the start-of-forward hook
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            # first, as DeepSpeed registered it: the step resets before the root module records itself in the order
            offload.fwd_pre_hook = module.register_forward_pre_hook(start_of_forward, prepend=True)
            offload._register_deepspeed_module(module)


@contextlib.contextmanager
def plain_linear_forward():
    """For a stretch of forwards without gradients (generation): torch.nn.functional.linear as ZeRO-3's
    replacement computes it, minus the autograd Function around it. Not collective.

    zero.Init (on while a ZeRO-3 model loads) replaces F.linear process-wide with `zero3_linear_wrap`, an
    autograd Function whose every call binds its arguments through inspect.signature, a large share of a small
    model's decode step on CPU (docs/benchmarks.md). Without gradients the Function saves nothing, so calling
    its forward directly gives the same tensors, bit for bit. Elsewhere (no ZeRO-3) nothing changes."""
    import torch.nn.functional as F

    try:
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap
    except ImportError:
        yield
        return
    if F.linear is not zero3_linear_wrap or torch.is_grad_enabled():
        yield
        return
    F.linear = LinearFunctionForZeroStage3.forward
    try:
        yield
    finally:
        F.linear = zero3_linear_wrap
