"""What resuming on another number of ranks costs (trapo/engine/reshard.py), measured on the toy.

A 2-rank toy run saves a checkpoint (its `save` time is what every save costs, moving or not: nothing is
added at save time). The DeepSpeed state is then converted to DeepSpeed's universal form, as the first
resume on another rank count does, and the bench prints the time and the bytes beside the native state's.
For Qwen2.5-Math-7B it projects the universal form's size from the memory plan's parameter count (fp32 master
weights and two Adam moments, 12 bytes a parameter) and the time at a disk's read and write rate: arithmetic,
not a measurement.
Run: make bench (or .venv/bin/python bench/bench_reshard.py).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trapo import runtime  # noqa: E402

runtime.configure()

from trapo.commands.toy import build_assets  # noqa: E402
from trapo.config import load_config  # noqa: E402
from trapo.engine.checkpoint import DEEPSPEED_TAG  # noqa: E402
from trapo.engine.model_shapes import BUILTIN  # noqa: E402
from trapo.engine.reshard import convert  # noqa: E402

DISK_GBPS = 1.0  # a node's local NVMe or a parallel filesystem, per direction (an assumption, stated)


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        toy_args = [f"toy.dir={work / 'toy'}", "toy.labeled=16", "toy.unlabeled=48", "toy.test=16", "toy.sft_steps=150"]
        # the toy the run loads (configs/toy.yaml under these overrides), so that it finds it built
        build_assets(load_config(str(ROOT / "configs" / "toy.yaml"), toy_args).toy, log=lambda m: None)
        launcher = Path(sys.executable).parent / "deepspeed"
        args = [
            *toy_args,
            f"output_dir={work}",
            "run_name=two",
            "progress_bar=false",
            "train.rollout_batch_size=16",
            "train.update_batch_size=16",
            "max_steps=2",
            "save_steps=2",
        ]
        port = str(29500 + os.getpid() % 1000)
        subprocess.run(
            [str(launcher), "--num_gpus", "2", "--master_port", port, str(ROOT / "trapo_train.py"), *args],
            cwd=ROOT,
            env=runtime.subprocess_env(),
            check=True,
            capture_output=True,
        )
        row = json.loads((work / "two" / "metrics.jsonl").read_text().splitlines()[-1])
        ckpt = work / "two" / "checkpoints" / "step-2"
        native = size(ckpt / "ds")
        started = time.perf_counter()
        convert(ckpt, DEEPSPEED_TAG, work / "universal")
        seconds = time.perf_counter() - started
        universal = size(work / "universal")
    print(
        f"toy, saved on 2 ranks: a save takes {row['timing']['save']:.2f} s, the same whether or not the run "
        f"ever moves (nothing is added at save time)"
    )
    print(
        f"toy: DeepSpeed state {native / 1e6:.1f} MB in per-rank files; universal form {universal / 1e6:.1f} MB "
        f"({universal / native:.2f}x), converted in {seconds:.1f} s, once, at the first resume on another rank "
        "count (mostly the converter's start-up at this size)"
    )
    arch = BUILTIN["Qwen2.5-Math-7B"]
    gb = arch.params * 12 / 1e9
    print(
        f"Qwen2.5-Math-7B ({arch.params / 1e9:.2f}e9 parameters): universal form ~{gb:.0f} GB (fp32 master + two "
        f"Adam moments), read once and written once: ~{2 * gb / DISK_GBPS / 60:.0f} min at {DISK_GBPS:g} GB/s each "
        "way (projection from sizes, not a measurement)"
    )


if __name__ == "__main__":
    main()
