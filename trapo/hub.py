"""Models and datasets named by a local directory or a Hugging Face hub id.

    snap = fetch("Qwen/Qwen2.5-Math-7B", revision="main", what="model.path")   # -> Snapshot
    snap.local_dir   # a directory transformers and vLLM load from (the hub cache's snapshot)
    snap.commit      # the commit the revision resolved to (None for a local directory)

A name that is an existing directory is used as it is. Anything else that reads as a hub id (`name` or
`org/name`) is downloaded through `huggingface_hub` into its cache, only the files a run reads (`KINDS`):
safetensors weights, configs and tokenizer files for a model; parquet and JSONL files for a dataset.
huggingface_hub's own variables apply: HF_HOME and HF_HUB_CACHE say where the cache is, HF_TOKEN
authenticates, and HF_HUB_OFFLINE=1 reads the cache without a network call. A name that cannot be had
(offline and not cached, no such repository, a gated one, no such revision) is one `HubError` line that
names it and the fix, before any model loads.

Callers on several ranks download once per node (`trapo.engine.dist.once_per_node`): local rank 0 fetches,
the others read the cache it filled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trapo.config import ConfigError

# What a run reads, per kind of repository: a model's weights (safetensors only: transformers 5 and vLLM
# load them without pickle), its configs, tokenizer and chat template; a dataset's parquet and JSONL files.
KINDS = {
    "model": ("model", ["*.safetensors", "*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]),
    "tokenizer": ("model", ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]),
    "dataset": ("dataset", ["*.parquet", "*.jsonl"]),
}
# The hub's repository names: an optional owner and a name, letters, digits, '-', '_' and '.' (not leading).
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(ConfigError):
    """A model or dataset name that cannot be had: one line naming it and the fix."""


@dataclass(frozen=True)
class Snapshot:
    source: str  # what the user named: a directory or a hub id
    local_dir: Path  # where its files are
    commit: str | None = None  # the hub commit (None: a local directory)
    revision: str | None = None  # what the user asked for (a branch, tag or commit), None: the default branch

    @property
    def label(self) -> str:
        """`org/name@commit` for a hub snapshot, the directory otherwise (for records and settings)."""
        return f"{self.source}@{self.commit}" if self.commit else str(self.local_dir)


def is_hub_id(name: str) -> bool:
    """Reads as a hub id, and is no existing path: `org/name` or `name` (a local path such as ./m or /x/m is not)."""
    return bool(HUB_ID.fullmatch(name)) and not Path(name).exists() and ".." not in name


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, looked up now (the library reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def fetch(
    name: str, revision: str | None = None, *, kind: str = "model", what: str = "model.path", cached_only: bool = False
) -> Snapshot:
    """The local directory of `name`: itself when it is a directory, else its hub snapshot at `revision`
    (downloaded unless cached; `cached_only` or HF_HUB_OFFLINE=1: the cache alone). `what` names the
    setting or option in errors."""
    if Path(name).is_dir():
        if revision:
            raise HubError(f"{what} {name}: a local directory has no revision; drop the revision, or name a hub id")
        if (Path(name) / CONVERSION_MANIFEST).is_file() and (problem := conversion_problem(Path(name))):
            raise HubError(f"{what} {name}: {problem}; convert it again (`trapo get-model --force`)")
        return Snapshot(name, Path(name))
    if Path(name).exists():
        raise HubError(f"{what} {name}: a file, not a directory; name the directory that holds it")
    if not is_hub_id(name):
        # models/ is where `trapo get-model` writes the models it converts (configs/real_smollm2.yaml's)
        hint = "; get it first: `trapo get-model` (make get-model)" if Path(name).parent.name == "models" else ""
        raise HubError(
            f"{what} {name}: no such directory, and not a Hugging Face hub id (`org/name`); "
            f"fix the path, or name a hub repository{hint}"
        )
    repo_type, patterns = KINDS[kind]
    local_only = cached_only or offline()
    try:
        folder = _snapshot_download(name, revision, repo_type, patterns, local_only)
    except Exception as err:  # noqa: BLE001 - huggingface_hub's many errors become one line, classified below
        raise HubError(_explain(err, name, revision, what, repo_type, local_only)) from None
    snap = Snapshot(name, Path(folder), Path(folder).name if COMMIT.fullmatch(Path(folder).name) else None, revision)
    if kind == "model":
        _check_model(snap, what)
    return snap


def _snapshot_download(name: str, revision: str | None, repo_type: str, patterns: list[str], local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(
        name,
        revision=revision,
        repo_type=repo_type,
        allow_patterns=patterns,
        cache_dir=cache_dir(),
        local_files_only=local_only,
    )


def _explain(err: Exception, name: str, revision: str | None, what: str, repo_type: str, local_only: bool) -> str:
    """One line for a failed fetch: what is wrong with `name` and what to do."""
    from huggingface_hub import errors

    at = f" at revision {revision}" if revision else ""
    where = f"{what} {name}{at}"
    download = f"`hf download {name}{' --repo-type dataset' if repo_type == 'dataset' else ''}`"
    if isinstance(err, errors.GatedRepoError):
        return f"{where}: a gated repository; accept its terms on huggingface.co, then set HF_TOKEN"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            f"{where}: no such {repo_type} repository on the Hugging Face hub (a private one needs HF_TOKEN); "
            "check the name, or name a local directory"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        return f"{where}: the repository has no such branch, tag or commit; check the revision"
    if isinstance(err, errors.IncompleteSnapshotError):
        return f"{where}: its copy in the hub cache ({cache_dir()}) is incomplete; run {download} with network"
    if isinstance(err, errors.LocalEntryNotFoundError):
        why = " while HF_HUB_OFFLINE=1" if offline() else "" if local_only else " and the hub cannot be reached"
        return (
            f"{where}: not a local directory, and not in the hub cache ({cache_dir()}){why}; "
            f"download it where there is network ({download}, with HF_HOME or HF_HUB_CACHE pointing at this "
            "cache), or name a local directory"
        )
    first = str(err).splitlines()[0] if str(err) else ""
    return f"{where}: the Hugging Face hub failed ({type(err).__name__}: {first})"


# Written last by `trapo get-model` into a directory it converted (trapo/commands/get_model.py): every file's
# size and sha256, so a copy cut short or damaged later is refused instead of loaded.
CONVERSION_MANIFEST = "trapo-conversion.json"


def file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def conversion_problem(model_dir: Path, hashes: bool = False) -> str | None:
    """What is wrong with a converted model directory against its manifest, or None: no manifest (a conversion
    that never finished), a file missing or of another size, or with `hashes` another sha256."""
    import json

    manifest = Path(model_dir) / CONVERSION_MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"no {CONVERSION_MANIFEST} (not a finished conversion)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{CONVERSION_MANIFEST} cannot be read ({err})"
    for name, want in sorted(files.items()):
        f = Path(model_dir) / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, its manifest says {want['bytes']} (damaged or cut short)"
        if hashes and file_sha256(f) != want["sha256"]:
            return f"{name} does not have its manifest's sha256 (damaged)"
    return None


def weight_problem(model_dir) -> str | None:
    """What is wrong with a model directory's safetensors files, read from their headers alone (no tensor is
    loaded), or None: a shard the index names that is missing, a header that does not parse, or a file shorter
    than its header says (a truncated copy or download)."""
    import json
    import struct

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            return f"{index.name}: cannot read its weight_map ({err})"
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            return f"{missing[0]} is missing (named by {index.name}; {len(missing)} of {len(shards)} shards absent)"
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n)) if 8 + n <= size else None
        except (OSError, ValueError, struct.error) as err:
            return f"{f.name}: not a readable safetensors file ({err})"
        if header is None:
            return f"{f.name}: truncated ({size} bytes, shorter than its own header)"
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
        expected = 8 + n + max(ends, default=0)
        if size < expected:
            return f"{f.name}: truncated ({size} of {expected} bytes); copy or download it again"
    return None


def _check_model(snap: Snapshot, what: str) -> None:
    """A model snapshot holds a config.json and safetensors weights (a .bin-only repository is not loaded)."""
    d = snap.local_dir
    if not (d / "config.json").is_file():
        raise HubError(f"{what} {snap.source}: its snapshot {d} has no config.json; is it a model repository?")
    if not any(d.rglob("*.safetensors")):
        raise HubError(
            f"{what} {snap.source}: its snapshot {d} has no .safetensors weights (this trainer does not load "
            "pickled .bin files); convert the weights to safetensors, or name a local directory"
        )
