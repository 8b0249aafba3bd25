"""A run directory's owner and its record: one run at a time, a first config that stays, every start logged.

    claim(run_dir)                       # rank 0, before anything is written there; ConfigError when held
    changes = resume_changes(run_dir, as_run, allowed, checkpoint)   # a resume: refused keys raise
    record_start(run_dir, {...})          # one line of starts.jsonl per start
    as_run(cfg, snapshot)                 # the config as recorded: a hub model's revision pinned to its commit
    cfg = resolve_backend(cfg)            # rollout.backend auto -> what runs (a resume: what it started with)

The lock is `run_dir/.lock` under `fcntl.flock`, held by rank 0 for the life of its process: the kernel drops
it when the process ends, however it ends (kill -9 included), so no stale lock is left to clean up. A run
that finds it held stops in one line naming the holder (host, pid, since when), read from the lock file.
On shared filesystems: NFS (v3 with lockd, v4) carries the lock across clients, since Linux emulates flock
there with NFS byte-range locks; Lustre does with its `flock` mount option, excludes only runs on the same
node with `localflock`, and refuses the call with neither (`noflock`), in which case the run says so once
and goes on unlocked.

`config.yaml` is written by a run's first start and never overwritten by a resume. A resume compares its
config (a hub model's revision pinned to its commit) with it, key by key: a key in `SAFE` may change; any
other change is refused, listing each key with its old and new value, unless `resume_changes` names it; a
key in `FIXED` (the adapters' rank and layers, the dtype) is refused even then: the checkpoint cannot load.
`starts.jsonl` records every start: when, where, the step it started at, the world size and the changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

import yaml

from trapo import console, hub
from trapo.config import Config, ConfigError, ModelConfig, flatten, validate
from trapo.engine import lora
from trapo.engine.rollout import choose_backend

LOCK = ".lock"
STARTS = "starts.jsonl"
# Keys a resume may change: they decide how long the run goes, what it saves and logs, how it evaluates
# and how it uses memory or processes, never which samples it draws or how it updates on them.
SAFE = (
    "max_steps",
    "epochs",
    "save_steps",
    "keep_checkpoints",
    "resume_from",
    "resume_changes",
    "progress_bar",
    "dist_timeout_minutes",
    "output_dir",
    "run_name",
    "logging.",
    "eval.",
    "reward.workers",
    "rollout.gpu_memory_utilization",
    "rollout.cpu_kv_cache_gb",
    "rollout.enable_sleep_mode",
    "model.gradient_checkpointing",  # recomputed activations equal the kept ones: memory and time only
)

# Keys no resume can change, even named in resume_changes: the checkpoint's saved state takes its shape from
# them, so it cannot load (DeepSpeed would stop with a size mismatch after the model and vLLM loaded).
# model.lora.alpha and dropout may change when named: the same adapters load, scaled or dropped otherwise.
# model.path may too: the same weights moved elsewhere resume (another base is named at the load, lora.py).
FIXED = {
    "model.lora.rank": "the checkpoint's adapters and their optimizer state have that rank (0: full weights)",
    "model.lora.target_modules": "the checkpoint holds adapters on those layers and no others",
    "model.dtype": "the checkpoint's DeepSpeed state (weights, master copy) was saved in that precision",
}

_held: dict[Path, int] = {}  # run directory -> the descriptor holding its lock (this process)


def claim(run_dir: Path) -> None:
    """Hold `run_dir`'s lock for this process's life (again in the same process: nothing to do). Creates the
    directory. ConfigError when another process holds it, or when the directory cannot be made or written."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    where = f"run directory {run_dir} (output_dir/run_name)"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{where}: a file is in the way; choose another run_name or output_dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(
            f"{where}: cannot create or write it ({err.strerror}); choose a writable output_dir"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise ConfigError(
                f"{where} is in use by {holder(run_dir)}; wait for that run to end (or stop it), or "
                "choose another run_name or output_dir"
            ) from None
        console.say(
            f"{run_dir}: cannot lock it ({err.strerror}: this filesystem has no flock, e.g. Lustre "
            "without the flock mount option); a second run into it would not be stopped"
        )
        _held[run_dir] = fd
        return
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}).encode(), 0)
    _held[run_dir] = fd


def holder(run_dir: Path) -> str:
    """'pid P on host H since T', from the lock file the holding run wrote."""
    try:
        info = json.loads((Path(run_dir) / LOCK).read_text())
        return f"pid {info['pid']} on host {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another run (its lock file names no holder yet)"


def release(run_dir: Path) -> None:
    """Drop the lock early (tests; a process's end drops it anyway)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE)


def fixed(key: str, old, new, adapters: bool = True) -> bool:
    """Whether a change of `key` from `old` to `new` is one no checkpoint can resume (FIXED): a reordered
    target list names the same layers (and without `adapters`, rank 0, none), and "auto" is the dtype it
    resolves to here."""
    if key == "model.lora.target_modules":
        return adapters and sorted(old or []) != sorted(new or [])
    if key == "model.dtype":
        from trapo.runtime import dtype_name

        return dtype_name(old) != dtype_name(new)
    return key in FIXED


def resume_changes(run_dir: Path, as_run: dict, allowed: list[str], checkpoint: Path | None = None) -> dict[str, list]:
    """{key: [old, new]} of every setting that differs from the run's config.yaml (none without one).
    ConfigError, listing each, when a key outside SAFE changed and `allowed` does not name it; ConfigError
    for a FIXED key's change whatever `allowed` names, pointing at a new run from `checkpoint`'s hf/. A key
    only one side knows (the schema grew or shrank between the starts) is not compared."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        first = flatten(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the run's config ({err}); restore it, or start a new run") from None
    now = flatten(as_run)
    changes = {k: [first[k], now[k]] for k in now if k in first and first[k] != now[k]}
    adapters = bool(now.get("model.lora.rank"))
    structural = {k: v for k, v in changes.items() if fixed(k, *v, adapters=adapters)}
    if structural:
        listed = "; ".join(f"{k}: {old!r} -> {new!r} ({FIXED[k]})" for k, (old, new) in structural.items())
        hf = (Path(checkpoint) if checkpoint else Path(run_dir) / "checkpoints" / "step-N") / "hf"
        raise ConfigError(
            f"resuming {run_dir}: no resume can change {listed}, even named in resume_changes; put the old "
            f"value back, or start a new run from the checkpoint's merged model: model.path={hf}, resume_from "
            "unset and another run_name"
        )
    refused = {k: v for k, v in changes.items() if not safe(k) and k not in allowed}
    if refused:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        hint = ""
        if "model.revision" in refused:
            hint = (
                f" (model.revision: the hub revision moved on; model.revision={refused['model.revision'][0]} resumes)"
            )
        raise ConfigError(
            f"resuming {run_dir} with settings that differ from its first start, which would break the run's "
            f"record and its exact resume: {listed}{hint}; put the old values back, or name the keys you mean to "
            f"change in resume_changes=[{','.join(refused)}]"
        )
    return changes


def open_run_dir(run_dir: Path, ckpt_root: Path, resume_from: str | None) -> None:
    """Rank 0, at a run's start: claim the directory, refuse another run's logs that this run would not
    resume (`check_run_dir`), and, under the lock, remove the partial checkpoint a killed save left."""
    from trapo.engine import checkpoint as ckpt  # here: `claim` runs before torch is imported (train command)

    claim(run_dir)
    ckpt.check_run_dir(run_dir, resume_from)
    for partial in ckpt.remove_partials(ckpt_root):  # it holds disk space the engines will want
        console.say(f"removed {partial}: a partial checkpoint left by an interrupted save")


def record_start(run_dir: Path, config_text: str, entry: dict) -> None:
    """Rank 0: write config.yaml at the run's first start (a resume keeps the first one), and append this
    start to starts.jsonl."""
    config = Path(run_dir) / "config.yaml"
    if entry.get("resumed_from") is None or not config.is_file():
        config.write_text(config_text)
    entry = {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **entry,
    }
    with open(Path(run_dir) / STARTS, "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def model_problem(model: ModelConfig, state: dict, commit: str | None, base: dict | None) -> str | None:
    """Why a checkpoint (its trainer state) cannot resume on this run's model, or None: a hub revision that
    now resolves to another commit, or LoRA adapters trained on another base (trapo/engine/lora.py)."""
    saved = state["model_commit"]
    if saved and commit and saved != commit:
        return (
            f"model.path {model.path}: the checkpoint trained from hub commit {saved}, and revision "
            f"{model.revision or '(default branch)'} now resolves to {commit}; resume with "
            f"model.revision={saved}, or start a new run"
        )
    problem = lora.base_problem(state["base_model"], base)
    return problem and f"model.path {model.path}: {problem}"


def as_run(cfg: Config, source: hub.Snapshot | None) -> Config:
    """The config as the run runs it: a hub model's revision pinned to the commit it resolved to."""
    if source is None or source.commit is None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, revision=source.commit))


def recorded(run_dir: Path, key: str):
    """The value of dotted `key` in the run's config.yaml, or None (no file, an unreadable one: the resume's
    own comparison reports that)."""
    try:
        return flatten(yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}).get(key)
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def resolve_backend(cfg: Config, say=console.say) -> Config:
    """`cfg` with rollout.backend "auto" made the engine that runs, said in one line (`say`): a resume
    (resume_from set) keeps the backend its config.yaml records unless resume_changes names rollout.backend;
    otherwise vLLM when it is installed, else hf, on either rollout placement. The result is what config.yaml
    records, so the next resume compares like with like. The backend's cross-key checks run again on the
    choice. A named backend: `cfg`."""
    if cfg.rollout.backend != "auto":
        return cfg
    before = None
    if cfg.resume_from and "rollout.backend" not in cfg.resume_changes:
        before = recorded(cfg.run_dir, "rollout.backend")
    backend, why = choose_backend("auto", before)
    say(f"rollout.backend auto: {backend} ({why})")
    chosen = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend=backend))
    validate(chosen, f"rollout.backend auto ({backend})")
    return chosen
