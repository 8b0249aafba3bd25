"""A finished run's record: what a study's report reads of the run, kept beside the report as
`<docs>/runs/<run>.json`, so that a study run in pieces on several machines (or clones) reports every run any
of them finished, and a run recorded there is not run again.

A record holds the run's launch with the machine's paths taken out (the checkout as relative paths, the run store
as `<runs>`), its step budget, its wall time and the report's values of it. A record is used only for the same
launch and budget; a run finished here replaces its record.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from trapo.commands.reproduce.plan import ROOT
from trapo.config import ConfigError


def path(docs: Path, run_dir: Path) -> Path:
    """Where the record of the run in `run_dir` lives under a report's docs directory."""
    return docs / "runs" / f"{run_dir.name}.json"


def portable(argv: list[str], run_dir: Path) -> list[str]:
    """A launch without this machine's paths: the interpreter dropped, the run store `<runs>`, the checkout
    relative."""
    store, root = str(run_dir.parent), str(ROOT) + "/"
    return [arg.replace(store, "<runs>").replace(root, "") for arg in argv[1:]]


def span(run_dir: Path) -> tuple[float, float] | None:
    """A training run's wall time as (start, end) epoch seconds: its first start (starts.jsonl) to its
    summary.json; None for a run without them (an evaluation)."""
    starts, summary = run_dir / "starts.jsonl", run_dir / "summary.json"
    if not (starts.is_file() and summary.is_file()):
        return None
    first = json.loads(starts.read_text().splitlines()[0])["time"]
    return datetime.datetime.fromisoformat(first).timestamp(), summary.stat().st_mtime


def write(dest: Path, condition: str, seed: int, steps: int, launch: list[str], values: dict, run_dir: Path) -> dict:
    """The record of a run finished here, written (atomic: a record is whole or absent) and returned."""
    times = span(run_dir)
    record = {
        "condition": condition,
        "seed": seed,
        "steps": steps,
        "launch": launch,
        "seconds": None if times is None else round(times[1] - times[0], 1),
        "values": values,
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(dest)
    return record


def read(source: Path, launch: list[str], steps: int) -> dict | None:
    """The record at `source` when it is of this launch and budget, else None (absent, or of another run)."""
    if not source.is_file():
        return None
    try:
        record = json.loads(source.read_text())
    except json.JSONDecodeError as err:
        record, why = None, str(err)
    else:
        why = "no launch, steps, seconds and values"
    if not (isinstance(record, dict) and {"launch", "steps", "seconds", "values"} <= record.keys()):
        raise ConfigError(f"{source}: not a run record ({why}); delete it, and the run runs again")
    if record["launch"] != launch or record["steps"] != steps:
        return None
    return record
