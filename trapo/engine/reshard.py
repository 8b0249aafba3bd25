"""A checkpoint saved on N ranks, loaded on M: ZeRO-3's partitions consolidated per parameter, then cut anew.

    load_moved(path, tag, rank=rank, engine=engine)   # collective; path: a checkpoint directory, tag: its
                                                     # DeepSpeed folder (trapo/engine/checkpoint.py)

DeepSpeed ZeRO-3 saves each rank's partition of the fp32 master weights and of the Adam moments in its own
file, in an order that depends on the world size, and refuses to load them into another world size. Its
universal checkpoint format holds each parameter whole instead (`zero/<name>/fp32.pt`, `exp_avg.pt`,
`exp_avg_sq.pt`, and the step), and a ZeRO-3 engine of any world size loads it, taking its own partition
of each tensor (DeepSpeed 0.19: `deepspeed/checkpoint/ds_to_universal.py` converts; `runtime/zero/stage3.py`
`load_hp_checkpoint_state_from_checkpoint_dir_stage3` loads, when the engine's `load_universal_checkpoint`
is set). So nothing changes at save time: the conversion runs once, at the resume that changes the world
size, by rank 0 into a scratch directory beside the checkpoint (`.step-N.universal.tmp`, removed after the
load; a start after a kill removes a leftover one with the other partial directories). The optimizer state is
restored, never reset. Its cost, one read and one write of the optimizer's bytes, is measured by
bench/bench_reshard.py. DeepSpeed's universal loader assigns the optimizer state without torch's placement of
it; `place_state` puts it back where torch's own `load_state_dict` would (the fused AdamW's step above all).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from trapo import runtime
from trapo.engine import dist


def scratch_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.universal.tmp"


def convert(path: Path, tag: str, out: Path) -> None:
    """The universal form of checkpoint `path`'s DeepSpeed state (its folder `tag`) into `out/tag` (rank 0; a
    subprocess, as DeepSpeed ships it, so its worker pools and prints stay out of the trainer)."""
    shutil.rmtree(out, ignore_errors=True)
    tag_dir = out / tag
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(path / tag),
        "--output_folder",
        str(tag_dir),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    done = subprocess.run(cmd, env=runtime.subprocess_env(), capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{path}: converting the DeepSpeed state for another world size failed ({tail[0]})")
    # The universal loader reads the run's client state from rank 0's model-states file, which the converter
    # does not always carry over under ZeRO-3.
    for model_states in (path / tag).glob("zero_pp_rank_0_mp_rank_*_model_states.pt"):
        shutil.copy(model_states, tag_dir / model_states.name)


def load_moved(path: Path, tag: str, *, rank: int, engine) -> None:
    """Load checkpoint `path` (its DeepSpeed folder `tag`), saved with another number of ranks, into `engine`
    (collective)."""
    scratch = scratch_dir(path)
    dist.on_rank0(lambda: convert(path, tag, scratch))
    engine._config.load_universal_checkpoint = True  # read by DeepSpeedEngine.load_checkpoint alone
    try:
        load_path, _ = engine.load_checkpoint(str(scratch), tag=tag)
    finally:
        engine._config.load_universal_checkpoint = False
    place_state(getattr(engine.optimizer, "optimizer", engine.optimizer))  # ZeRO's wrapper holds torch's AdamW
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    if load_path is None:
        raise FileNotFoundError(f"{path}: DeepSpeed could not load its universal form")


def place_state(optimizer: torch.optim.Optimizer) -> None:
    """Put every state tensor of torch `optimizer` where torch's `Optimizer.load_state_dict` would
    (`_process_value_according_to_param_policy`): on its parameter's device and dtype, `step` a float32
    tensor there when the optimizer is fused or capturable (else as loaded), each parameter its own tensor.

    DeepSpeed's universal loader assigns the state directly instead (its lines: docs/upstream-notes.md). Its
    `step` stays on the CPU, where ds_to_universal saved it, beside the parameters on the GPU, where the fused
    AdamW (policy.py: fused on GPU) updates it in its kernel; and ZeRO-3 gives one `step` tensor to every
    sub-group, so each sub-group's update would count that one again.
    """
    # ZeRO-3 empties param_groups' params between steps: the groups' flags are read without the params.
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    placed_ids = set()
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            if key == "step":
                placed = value.to(dtype=torch.float32, device=param.device) if on_device else value
            elif param.is_floating_point():
                placed = value.to(dtype=param.dtype, device=param.device)
            else:
                placed = value.to(device=param.device)
            if id(placed) in placed_ids:  # shared with another parameter's state: updated once per owner
                placed = placed.clone()
            placed_ids.add(id(placed))
            state[key] = placed
