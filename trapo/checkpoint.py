"""Checkpoint directories: atomic commit, discovery of the latest, pruning.

A checkpoint is written into `checkpoints/.step-N.tmp/` and renamed to
`checkpoints/step-N/` only after every rank has finished writing and rank 0
has written `COMPLETE`. A rename within one directory is atomic, so a crash
at any point leaves either the previous checkpoints alone or a `.tmp`
directory that no reader ever picks (and the next save removes).

Layout of `step-N/`:
    ds/                 DeepSpeed engine state (ZeRO-3 shards, optimizer, per rank)
    trainer_state.pt    `Trainer.state_dict()`: step, pass-rate tracker, bad-step count... (rank 0's copy)
    rng/rank-R.pt       RNG states per rank
    hf/                 config, safetensors weights, tokenizer: servable by vLLM as is
    COMPLETE

`save` and `restore` read and write that layout; they are collective (every
rank calls them). The functions below them only manage directories.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from trapo import dist

_STEP_DIR = re.compile(r"^step-(\d+)$")
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
DEEPSPEED_TAG = "ds"


def save(
    root: Path,
    step: int,
    *,
    rank: int,
    engine,
    weights: Iterable[tuple[str, torch.Tensor]],
    trainer_state: dict,
    model,
    tokenizer,
) -> Path:
    """Write checkpoint `step-N` atomically on every rank; returns its final path.

    engine: the DeepSpeed engine (each rank writes its shards); weights: the
    gathering iterator of full tensors (consumed on every rank, kept by rank 0
    for `hf/`); trainer_state: what `Trainer.load_state_dict` takes back.
    """
    tmp = staging_dir(root, step)
    if rank == 0:
        begin(root, step)
    dist.barrier()
    engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, save_latest=False)
    save_rng(tmp, rank)
    state = {}
    for name, tensor in weights:  # collective: every rank gathers, rank 0 keeps
        if rank == 0:
            state[name] = tensor.cpu().contiguous()
    if rank == 0:
        _write_hf(tmp / "hf", state, model, tokenizer)
        torch.save(trainer_state, tmp / TRAINER_STATE)
    dist.barrier()
    if rank == 0:
        commit(root, step)
    dist.barrier()
    return final_dir(root, step)


def write_best(path: Path, root: Path, best: dict) -> None:
    """best.json: the best validation score so far, its step and its checkpoint's directory (rank 0)."""
    path.write_text(json.dumps({**best, "checkpoint": str(final_dir(root, best["step"]))}, indent=2))


def read_trainer_state(path: Path) -> dict:
    """The trainer state saved in checkpoint `path` (not collective)."""
    return torch.load(path / TRAINER_STATE, weights_only=False)


def restore(path: Path, *, rank: int, engine) -> None:
    """Load the DeepSpeed engine state and this rank's RNG states from checkpoint `path`."""
    load_path, _ = engine.load_checkpoint(str(path), tag=DEEPSPEED_TAG)
    if load_path is None:
        raise FileNotFoundError(f"{path}/{DEEPSPEED_TAG}: DeepSpeed could not load the checkpoint")
    load_rng(path, rank)


def load_rng(directory: Path, rank: int) -> None:
    """Restore the Python, NumPy, torch (and CUDA) RNG states `save_rng` wrote for this rank."""
    rng = torch.load(directory / "rng" / f"rank-{rank}.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])


def save_rng(directory: Path, rank: int) -> None:
    """This rank's Python, NumPy, torch (and CUDA) RNG states into directory/rng/rank-R.pt."""
    (directory / "rng").mkdir(exist_ok=True)
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        },
        directory / "rng" / f"rank-{rank}.pt",
    )


def _write_hf(hf: Path, state: dict[str, torch.Tensor], model, tokenizer) -> None:
    """A Hugging Face directory vLLM and transformers load as is: weights, config, generation config, tokenizer."""
    from safetensors.torch import save_file

    hf.mkdir()
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(hf)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(hf)
    tokenizer.save_pretrained(hf)


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


def check_run_dir(run_dir: Path, resume_from: str | None) -> None:
    """ConfigError when a run that resumes nothing would start in a directory holding another run's
    metrics.jsonl: its rows would be appended to the earlier run's, and the earlier run's later
    checkpoints could win a `resume_from: latest`. Nothing is moved or deleted."""
    if (run_dir / "metrics.jsonl").is_file() and resolve(resume_from, run_dir / "checkpoints") is None:
        from trapo.config import ConfigError

        raise ConfigError(
            f"{run_dir} holds an earlier run (metrics.jsonl) and resume_from={resume_from} resumes no checkpoint "
            "of it: set resume_from=latest to continue it, choose another run_name or output_dir, or remove it"
        )


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
