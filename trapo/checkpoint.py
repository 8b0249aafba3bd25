"""Checkpoint directories: atomic commit, discovery of the latest, pruning.

A checkpoint is written into `checkpoints/.step-N.tmp/` and renamed to
`checkpoints/step-N/` only after every rank has finished writing and rank 0
has written `COMPLETE`. A rename within one directory is atomic, so a crash
at any point leaves either the previous checkpoints alone or a `.tmp`
directory that no reader ever picks (and the next save removes).

Layout of `step-N/`:
    ds/                 DeepSpeed engine state (ZeRO-3 shards, optimizer, per rank)
    trainer_state.pt    step, pass-rate tracker, bad-step count (rank 0's copy)
    rng/rank-R.pt       RNG states per rank
    hf/                 config, safetensors weights, tokenizer: servable by vLLM as is
    COMPLETE
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)$")
COMPLETE = "COMPLETE"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".step-{step}.tmp"


def final_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def begin(root: Path, step: int) -> Path:
    """Rank 0: a fresh, empty staging directory (leftovers of a crashed save are removed)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = staging_dir(root, step)
    tmp.mkdir()
    return tmp


def commit(root: Path, step: int) -> Path:
    """Rank 0, after all ranks wrote into the staging directory: mark and rename."""
    tmp, final = staging_dir(root, step), final_dir(root, step)
    (tmp / COMPLETE).write_text(f"{step}\n")
    if final.exists():  # re-saving a step after a resume: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / COMPLETE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def resolve(resume_from: str | None, root: Path) -> Path | None:
    """The checkpoint to resume from: None, 'latest' (None if there is none yet) or a path."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        done = list_complete(root)
        return done[-1][1] if done else None
    path = Path(resume_from)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"resume_from: {path} is not a complete checkpoint (no {COMPLETE} file)")
    return path


def prune(root: Path, keep: int | None, protect: int | None = None) -> None:
    """Keep the newest `keep` checkpoints, and step `protect` (the best so far) whatever its age."""
    if keep is None:
        return
    for step, path in list_complete(root)[:-keep]:
        if step != protect:
            shutil.rmtree(path, ignore_errors=True)
