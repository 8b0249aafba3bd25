"""File checksums of a checkpoint directory: recorded after writing, verified before loading.

Every function with `rank, world` is collective: each rank hashes its share of the files
(balanced by size, the same split on every rank) and the results are gathered, so a large
checkpoint is read in parallel. zlib's crc32 (GB/s per core: `bench/bench_checkpoint.py`)
catches truncation and damaged bytes; it is not a defence against someone who rewrites
both a file and its record.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

from trapo.engine import dist

CHUNK = 8 << 20  # bytes read at a time
MARKER = "COMPLETE"  # the checkpoint's own record (trapo/engine/checkpoint.py): never part of what it records


def files(directory: Path) -> list[str]:
    return [str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file() and f.name != MARKER]


def file_checksum(path: Path) -> list[int]:
    """[bytes, crc32] of one file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return [size, crc]


def _sums(directory: Path, names: list[str]) -> dict[str, list[int]]:
    return {name: file_checksum(directory / name) for name in names}


def _shared(directory: Path, names: list[str], rank: int, world: int, work: Callable) -> dict:
    """Collective: `work(directory, share)` on this rank's share of `names` (balanced by size), merged."""
    sizes = sorted(((directory / n).stat().st_size if (directory / n).is_file() else 0, n) for n in names)
    loads, shares = [0] * world, [[] for _ in range(world)]
    for size, name in reversed(sizes):  # longest first onto the least-loaded rank: deterministic everywhere
        r = loads.index(min(loads))
        loads[r] += size
        shares[r].append(name)
    merged = {}
    for part in dist.all_gather(work(directory, shares[rank])):
        merged.update(part)
    return merged


def record(directory: Path, rank: int = 0, world: int = 1) -> dict[str, list[int]]:
    """Collective: {relative path: [bytes, crc32]} of every file under `directory` (but its marker)."""
    return _shared(directory, sorted(files(directory)), rank, world, _sums)


def _damage(directory: Path, expected: dict[str, list[int]]):
    def check(_, names: list[str]) -> dict[str, str]:
        out = {}
        for name in names:
            f = directory / name
            if not f.is_file():
                out[name] = "missing"
            elif f.stat().st_size != expected[name][0]:
                out[name] = f"{f.stat().st_size} bytes, {expected[name][0]} written"
            elif file_checksum(f)[1] != expected[name][1]:
                out[name] = "checksum differs from the one written"
        return out

    return check


def verify(directory: Path, expected: dict[str, list[int]], rank: int = 0, world: int = 1) -> str | None:
    """Collective: what differs from `expected` ("ds/x.pt: 812 bytes, 3812928 written; ..."), or None."""
    found = _shared(directory, sorted(expected), rank, world, _damage(directory, expected))
    return "; ".join(f"{name}: {why}" for name, why in sorted(found.items())) or None
