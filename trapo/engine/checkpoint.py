"""Checkpoint directories: atomic commit, checksums, discovery of the latest whole one, pruning.

A checkpoint is written into `checkpoints/.step-N.tmp/` and renamed to
`checkpoints/step-N/` only after every rank has finished writing and rank 0
has written `COMPLETE`. A rename within one directory is atomic, so a crash
at any point leaves either the previous checkpoints alone or a `.tmp`
directory that no reader ever picks (removed at the next start or save).

Layout of `step-N/`:
    ds/                 DeepSpeed engine state (ZeRO-3 shards, optimizer, per rank)
    trainer_state.pt    `RunState.state_dict()`: step, pass-rate tracker, bad-step count... (rank 0's copy),
                        stamped with the format number STATE_FORMAT, checked on load
    rng/rank-R.pt       RNG states per rank
    hf/                 config, safetensors weights, tokenizer: servable by vLLM as is
    COMPLETE            JSON: {"step": N, "files": {relative path: [bytes, crc32]}} for every file above

`trainer_state.pt` and `rng/rank-R.pt` hold only tensors and plain Python
values and are read with `torch.load(weights_only=True)`: opening a shared
checkpoint runs no code of ours. (DeepSpeed 0.19.8 still reads its own `ds/`
shards with `weights_only=False`, in TorchCheckpointEngine.load.)

Failures a user meets end in `CheckpointError` (one line, exit status 74):
a save that will not fit is refused before anything is written; a save that
fails part-way removes its staging directory on every rank and keeps every
earlier checkpoint; `resume_from: latest` sets a damaged newest checkpoint
aside (renamed `step-N.damaged`) and takes the newest whole one.

`save` and `choose` are collective (every rank calls them); each rank
hashes and verifies its share of the files. The other functions only manage
directories (rank 0).
"""

from __future__ import annotations

import contextlib
import errno
import json
import random
import re
import shutil
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from trapo.engine import checksums, dist

_STEP_DIR = re.compile(r"^step-(\d+)$")
COMPLETE = checksums.MARKER
TRAINER_STATE = "trainer_state.pt"
STATE_FORMAT = 3  # raise it when a key of the trainer state is added, dropped or changes meaning
DEEPSPEED_TAG = "ds"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the cause, the directory and the fix."""

    EXIT_CODE = 74  # EX_IOERR


def save(
    root: Path,
    step: int,
    *,
    rank: int,
    world: int,
    engine,
    weights: Iterable[tuple[str, torch.Tensor]],
    trainer_state: dict,
    model,
    tokenizer,
    keep: int | None = None,
) -> Path:
    """Write checkpoint `step-N` atomically on every rank; returns its final path.

    engine: the DeepSpeed engine (each rank writes its shards); weights: the
    gathering iterator of full tensors (consumed on every rank, kept by rank 0
    for `hf/`); trainer_state: what `RunState.load_state_dict` takes back;
    keep: `keep_checkpoints`, named in the advice when the disk is too small.
    Raises CheckpointError on every rank when the checkpoint does not fit or
    any rank's write fails; nothing partial is left behind.
    """
    tmp = staging_dir(root, step)
    _raise_together(space_problem(root, step, estimate_bytes(model), keep) if rank == 0 else None)
    failure = _Failure()
    if rank == 0:
        failure.attempt(begin, root, step)
    _fail_together(failure, root, step)
    # A frozen LoRA base is not saved: DeepSpeed would write each rank's slice of it (docs/upstream-notes.md).
    failure.attempt(
        engine.save_checkpoint, str(tmp), tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True
    )
    if failure:  # DeepSpeed's closing barrier, which this rank skipped: every rank makes one
        dist.barrier()
    failure.attempt(save_rng, tmp, rank)
    state = {}
    for name, tensor in weights:  # collective: every rank gathers, rank 0 keeps
        if rank == 0:
            state[name] = tensor.cpu().contiguous()
    if rank == 0:
        failure.attempt(_write_hf, tmp / "hf", state, model, tokenizer)
        failure.attempt(write_trainer_state, tmp, trainer_state)
    _fail_together(failure, root, step)
    # Read back right after writing: each rank hashes its share, rank 0 records them all.
    files = failure.attempt(checksums.record, tmp, rank, world)
    _fail_together(failure, root, step)
    if rank == 0:
        failure.attempt(commit, root, step, files)
    _fail_together(failure, root, step)
    return final_dir(root, step)


# ----------------------------------------------------------------------------- failing safely


class _Failure:
    """The first exception this rank met while writing, with its traceback (for log.txt)."""

    def __init__(self):
        self.error: BaseException | None = None
        self.trace = ""

    def __bool__(self) -> bool:
        return self.error is not None

    def attempt(self, fn, *args, **kwargs):
        """fn(...)'s result; once this rank has failed, nothing more is tried (its collectives still run)."""
        if self.error is not None:
            return None
        try:
            return fn(*args, **kwargs)
        # Any failure (ENOSPC, EIO, torch's zip writer, safetensors) must leave no partial
        # checkpoint and keep the ranks in step; its traceback goes to log.txt.
        except Exception as err:  # noqa: BLE001
            self.error, self.trace = err, traceback.format_exc()
            return None


def describe(err: BaseException, directory: Path) -> str:
    """The cause of a failed write, in words (a full disk is said so even through torch's zip writer)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({err.strerror}: {err.filename or directory})"
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = None
    if free is not None and free < checksums.CHUNK:  # less than one write's worth left
        return f"the disk is full ({_size(free)} free; the writer said: {text})"
    return f"{type(err).__name__}: {text}"


def _fail_together(failure: _Failure, root: Path, step: int) -> None:
    """Collective: if any rank failed, every rank removes the staging directory and raises the same error."""
    mine = None
    if failure:
        cause = describe(failure.error, root)
        # The disk's advice applies to an OSError or a disk found full; anything else points to the log.
        mine = (cause, failure.trace, isinstance(failure.error, OSError) or cause.startswith("the disk is full"))
    failed = dist.all_gather(mine)
    if not any(failed):
        return
    shutil.rmtree(staging_dir(root, step), ignore_errors=True)
    dist.barrier()
    first_rank, (cause, trace, disk) = next((r, f) for r, f in enumerate(failed) if f)
    with contextlib.suppress(OSError):  # log.txt, which may sit on the disk that just filled up
        print(f"checkpoint step-{step}: rank {first_rank} failed:\n{trace}", file=sys.stderr, flush=True)
    done = list_complete(root)
    raise CheckpointError(
        f"checkpoint step-{step} was not saved: {cause}. Removed the partial {staging_dir(root, step)}; "
        f"every earlier checkpoint is kept (last good: {done[-1][1] if done else 'none'}). "
        + (
            "Free space there, lower keep_checkpoints or set output_dir to a larger disk, then run again with "
            "resume_from=latest"
            if disk
            else "The traceback is in log.txt; fix the cause, then run again with resume_from=latest"
        )
    )


def _raise_together(problem: str | None) -> None:
    """Collective: rank 0's verdict, raised on every rank."""
    problem = dist.all_gather(problem)[0]
    if problem:
        raise CheckpointError(problem)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError


def estimate_bytes(model) -> int:
    """A first checkpoint's size before any exists: for each trained parameter, ZeRO-3's fp32 master weight
    and two Adam moments (12 bytes) plus the parameter in the model's dtype; `hf/` holds every weight again
    in that dtype (a frozen LoRA base only there). (ZeRO-3 parameters report their full size in `ds_numel`.)"""
    total = trained = element = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())
        total += numel
        trained += numel if p.requires_grad else 0
        element = p.element_size()
    return trained * (12 + element) + total * element


def space_problem(root: Path, step: int, estimate: int, keep: int | None) -> str | None:
    """Why checkpoint `step` will not fit on root's filesystem, or None. Needed: the newest checkpoint's
    size (the same model and optimizer), else `estimate`; the older checkpoints stay until it is whole."""
    root.mkdir(parents=True, exist_ok=True)
    done = list_complete(root)
    needed = sum(f.stat().st_size for f in done[-1][1].rglob("*") if f.is_file()) if done else estimate
    basis = f"the size of {done[-1][1].name}" if done else "an estimate from the parameter count"
    free = shutil.disk_usage(root).free
    if needed <= free:
        return None
    held = f"{len(done)} checkpoints kept" + (f" (keep_checkpoints={keep})" if keep else "")
    return (
        f"checkpoint step-{step} needs about {_size(needed)} ({basis}) but {root} has {_size(free)} free, "
        f"with {held}: nothing was written. Lower keep_checkpoints (older checkpoints are pruned when a run "
        "starts), free space, or set output_dir to a larger disk; then run again with resume_from=latest"
    )


# ----------------------------------------------------------------------------- integrity


def manifest(path: Path) -> dict[str, list[int]] | None:
    """The files recorded in checkpoint `path`'s COMPLETE marker; None for a checkpoint written before
    checksums were kept (its marker holds only the step)."""
    text = (path / COMPLETE).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data.get("files") if isinstance(data, dict) else None


def damaged(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Collective: what is wrong with checkpoint `path` ("ds/...: 812 bytes, 3812928 written"), or None."""
    expected = manifest(path)
    if expected is None:
        return None
    return checksums.verify(path, expected, rank, world)


def choose(resume_from: str | None, root: Path, rank: int = 0, world: int = 1, warn=print) -> Path | None:
    """Collective: the checkpoint to resume from, verified. 'latest' walks back from the newest,
    setting damaged ones aside (rank 0 renames; every rank agrees on the one chosen); an explicit path
    that is damaged raises CheckpointError."""
    if resume_from is None:
        return None
    if resume_from != "latest":
        path = resolve(resume_from, root)
        problem = damaged(path, rank, world)
        if problem:
            raise CheckpointError(
                f"resume_from: {path} is damaged ({problem}); resume from another checkpoint "
                f"(resume_from=latest takes the newest whole one under {root})"
            )
        return path
    candidates = dist.all_gather([str(p) for _, p in list_complete(root)] if rank == 0 else None)[0]
    for name in reversed(candidates):
        path = Path(name)
        problem = damaged(path, rank, world)
        if problem is None:
            return path
        if rank == 0:
            aside = set_aside(path)
            warn(f"warning: checkpoint {path} is damaged ({problem}); set aside as {aside.name}, trying an older one")
        dist.barrier()
    if candidates:
        raise CheckpointError(f"resume_from: latest: every checkpoint under {root} is damaged (set aside, not deleted)")
    return None


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the way (never delete it): step-N.damaged, .damaged-2, ..."""
    for i in range(1, 1000):
        aside = path.with_name(f"{path.name}.damaged" + (f"-{i}" if i > 1 else ""))
        if not aside.exists():
            path.rename(aside)
            return aside
    raise CheckpointError(f"{path}: cannot set it aside (too many {path.name}.damaged-N)")


def write_best(path: Path, root: Path, best: dict) -> None:
    """best.json: the best validation score so far, its step and its checkpoint's directory (rank 0)."""
    path.write_text(json.dumps({**best, "checkpoint": str(final_dir(root, best["step"]))}, indent=2))


def write_trainer_state(path: Path, state: dict) -> None:
    """trainer_state.pt in checkpoint directory `path`, stamped with this version's STATE_FORMAT."""
    torch.save({**state, "format": STATE_FORMAT}, path / TRAINER_STATE)


def read_trainer_state(path: Path) -> dict:
    """The trainer state saved in checkpoint `path` (not collective); tensors and plain values only. A state
    of another format is refused: no release exists, so no older layout is read (docs/outputs.md)."""
    state = _load_plain(path / TRAINER_STATE)
    found = state.get("format") if isinstance(state, dict) else None
    if found != STATE_FORMAT:
        written = "no format number" if found is None else f"format {found!r}"
        raise CheckpointError(
            f"{path / TRAINER_STATE}: {written}, and this trapo reads trainer state format {STATE_FORMAT} only; "
            "resume it with the trapo version that wrote it, or start the run afresh"
        )
    return state


def _load_plain(file: Path):
    """torch.load with weights_only=True. Files from before checkpoints were code-free hold NumPy arrays
    (the NumPy RNG state): those load with only NumPy's array reconstruction allowed, still no code."""
    try:
        return torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; this is not a complete checkpoint") from None
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError here
        numpy_types = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
        try:
            with torch.serialization.safe_globals(numpy_types):
                return torch.load(file, weights_only=True)
        except Exception:  # noqa: BLE001 - the same set; the first error says more
            pass
        raise CheckpointError(
            f"{file}: cannot be read as a checkpoint of tensors and plain values ({str(err).splitlines()[0]}); "
            "it is damaged, or holds pickled objects that this trainer does not load"
        ) from None


def restore(path: Path, *, rank: int, engine, saved_world: int | None = None, world: int | None = None) -> None:
    """Load the DeepSpeed engine state and this rank's RNG states from checkpoint `path`. Saved with another
    number of ranks (`saved_world` != `world`): through DeepSpeed's universal form (trapo/engine/reshard.py),
    and a rank the saving run did not have takes rank 0's RNG states."""
    if saved_world is not None and world is not None and saved_world != world:
        from trapo.engine.reshard import load_moved

        load_moved(path, DEEPSPEED_TAG, rank=rank, engine=engine)
        load_rng(path, rank if rank < saved_world else 0)
        return
    # Without the frozen base's (placeholder) entries a strict load would refuse the module states.
    strict = all(p.requires_grad for p in engine.module.parameters())
    load_path, _ = engine.load_checkpoint(str(path), tag=DEEPSPEED_TAG, load_module_strict=strict)
    if load_path is None:
        raise FileNotFoundError(f"{path}/{DEEPSPEED_TAG}: DeepSpeed could not load the checkpoint")
    load_rng(path, rank)


def load_rng(directory: Path, rank: int) -> None:
    """Restore the Python, NumPy, torch (and CUDA) RNG states `save_rng` wrote for this rank."""
    rng = _load_plain(directory / "rng" / f"rank-{rank}.pt")
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = rng["numpy"]
    if isinstance(numpy_state, dict):
        keys = numpy_state["keys"].numpy().astype(np.uint32)
        numpy_state = (numpy_state["kind"], keys, numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])


def save_rng(directory: Path, rank: int) -> None:
    """This rank's Python, NumPy, torch (and CUDA) RNG states into directory/rng/rank-R.pt (plain values)."""
    (directory / "rng").mkdir(exist_ok=True)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    torch.save(
        {
            "python": random.getstate(),
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
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


def remove_partials(root: Path) -> list[Path]:
    """Rank 0: remove the staging directories of saves that never committed (a killed or failed run)."""
    stale = sorted(root.glob(".step-*.tmp")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def begin(root: Path, step: int) -> Path:
    """Rank 0: a fresh, empty staging directory (leftovers of a crashed save are removed)."""
    root.mkdir(parents=True, exist_ok=True)
    remove_partials(root)
    tmp = staging_dir(root, step)
    tmp.mkdir()
    return tmp


def commit(root: Path, step: int, files: dict[str, list[int]] | None = None) -> Path:
    """Rank 0, after all ranks wrote into the staging directory: mark (with each file's size and
    checksum) and rename."""
    tmp, final = staging_dir(root, step), final_dir(root, step)
    marker = json.dumps({"step": step, "files": files if files is not None else checksums.record(tmp)})
    (tmp / COMPLETE).write_text(marker + "\n")
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

        if resume_from == "latest":  # it ran, and stopped before its first save: there is nothing to resume
            raise ConfigError(
                f"{run_dir} holds an earlier run (metrics.jsonl) that stopped before its first checkpoint, so "
                f"resume_from=latest has nothing to resume: remove {run_dir} to start it over, or choose another "
                "run_name or output_dir"
            )
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
