"""Checkpoint checksum cost: crc32 throughput over a file just written, and what it means for a 7B run.

Writes a 512 MB file into a temporary directory (the page cache holds it, as it holds a checkpoint
right after its save), times `trapo.engine.checksums.file_checksum` on it beside a plain read of the same
file, and projects the per-rank hashing time of a Qwen2.5-Math-7B checkpoint (bf16 `hf/` weights and
ZeRO-3 bf16 partitions, fp32 master and two Adam moments: about 120 GB) split over 8 ranks. The projection is arithmetic
from this machine's figure, not a GPU-node measurement: a node's disk may be slower than its CPU.
Run: make bench (or .venv/bin/python bench/bench_checkpoint.py).
"""

import os
import tempfile
import time
from pathlib import Path

from trapo.engine.checksums import CHUNK, file_checksum

SIZE = 512 << 20
PARAMS_7B = 7.6e9  # Qwen2.5-Math-7B
RANKS = 8


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard.bin"
        path.write_bytes(os.urandom(SIZE))
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(CHUNK):
                pass
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        file_checksum(path)
        hash_s = time.perf_counter() - t0
    gbps = SIZE / hash_s / 1e9
    ckpt_7b = PARAMS_7B * (12 + 2 + 2)  # ZeRO-3 optimizer + bf16 params in ds/, bf16 hf/
    print(
        f"read {SIZE >> 20} MB: {read_s * 1000:.0f} ms; read + crc32: {hash_s * 1000:.0f} ms "
        f"({gbps:.2f} GB/s, {hash_s / read_s:.2f}x the plain read)"
    )
    print(
        f"7B checkpoint ~{ckpt_7b / 1e9:.0f} GB over {RANKS} ranks: ~{ckpt_7b / RANKS / (gbps * 1e9):.1f} s of hashing "
        f"per rank at this rate (projection, not a measurement)"
    )


if __name__ == "__main__":
    main()
