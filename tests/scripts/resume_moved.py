"""A small ZeRO-3 engine's optimizer state, saved on the ranks this is launched with and resumed on another
number through DeepSpeed's universal form (tests/engine/test_reshard_state.py; on a GPU, the issue's check).

    deepspeed --num_gpus 2 tests/scripts/resume_moved.py save DIR     # 2 steps, then DIR/ds and DIR/rng
    python tests/scripts/resume_moved.py resume DIR 2                 # prints one JSON line (`report`)

The engine is built as trapo/engine/policy.py builds the policy's: torch's AdamW, fused on GPU, bf16 there.
A small sub_group_size cuts each rank's partition into several ZeRO-3 sub-groups, each its own state."""

import json
import sys
from pathlib import Path

from trapo import runtime

runtime.configure()

import torch  # noqa: E402

from trapo.engine import checkpoint as ckpt  # noqa: E402
from trapo.engine import dist  # noqa: E402


def engine():
    deepspeed = dist.import_deepspeed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    on_gpu = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=on_gpu)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "sub_group_size": 40},
        "bf16": {"enabled": on_gpu},
    }
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def train_step(eng, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(eng.device, eng.module[0].weight.dtype)
    eng.backward(eng(x).float().pow(2).mean())
    eng.step()


def report(eng) -> dict:
    """Where each optimizer state tensor sits against its ZeRO-3 partition, and each sub-group's step."""
    torch_optimizer = eng.optimizer.optimizer
    states = list(torch_optimizer.state.items())
    return {
        "devices": sorted({f"{v.device}/{p.device}" for p, s in states for v in s.values() if torch.is_tensor(v)}),
        "misplaced": [k for p, s in states for k, v in s.items() if torch.is_tensor(v) and v.device != p.device],
        "steps": [float(s["step"]) for _, s in states],
        "step_dtypes": sorted({str(s["step"].dtype) for _, s in states}),
        "distinct_steps": len({id(s["step"]) for _, s in states}),
        "fused": bool(torch_optimizer.param_groups[0].get("fused")),
    }


def main(mode: str, directory: str, saved_world: int = 0) -> None:
    rank, world, _ = dist.init_distributed()
    eng, path = engine(), Path(directory)
    if mode == "save":
        for step in range(2):
            train_step(eng, step)
        eng.save_checkpoint(str(path), tag=ckpt.DEEPSPEED_TAG, save_latest=False)
        ckpt.save_rng(path, rank)
        return
    ckpt.restore(path, rank=rank, engine=eng, saved_world=saved_world, world=world)
    loaded = report(eng)
    train_step(eng, 2)
    if rank == 0:
        print(json.dumps({"loaded": loaded, "after_step": report(eng)}))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]  # a launcher's (tests/toyrun.py Ranks)
    main(args[0], args[1], *map(int, args[2:]))
