"""The files the project ships beside its code: the configs (paper, toy, DeepSpeed, studies, Slurm) and the
evaluation sets, found by name from any working directory.

    config_path("trapo_1k_3k")               # ./trapo_1k_3k(.yaml) if it is here, else the shipped one
    config_path("configs/deepspeed_zero3.json")   # a config naming another shipped file: the same rule
    shipped("configs")                       # the folder itself; shipped("benchmarks"): the evaluation sets

Where the shipped files are: in a clone (and its editable install) the repository's own `configs/` and
`data/benchmarks/`, where users edit them; in an installed wheel, `trapo/_shipped/configs/` and
`trapo/_shipped/benchmarks/`, copied there at build time (setup.py). A path the user gives is read relative to
the working directory first, as any path is; only when no such file is there does a shipped one of that name
(with or without `configs/` in front, with or without `.yaml`) stand in. A path that is neither comes back
as given, so that reading it fails naming it (the readers add `NOT_FOUND`). Imports nothing from trapo: every
layer may use it.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CLONE = PACKAGE.parent
# name -> (its place in an installed package, its place in the repository)
SHIPPED = {
    "configs": (PACKAGE / "_shipped" / "configs", CLONE / "configs"),
    "benchmarks": (PACKAGE / "_shipped" / "benchmarks", CLONE / "data" / "benchmarks"),
}


def shipped(name: str) -> Path:
    """The shipped folder `name` ("configs" or "benchmarks"): the installed package's copy when there is one,
    else the repository's folder (a clone, an editable install)."""
    installed, repository = SHIPPED[name]
    return installed if installed.is_dir() else repository


def _shipped_candidates(text: str) -> list[Path]:
    rel = Path(text)
    if rel.is_absolute() or ".." in rel.parts:
        return []
    if rel.parts and rel.parts[0] == "configs":  # how the configs name each other: configs/deepspeed_zero3.json
        rel = Path(*rel.parts[1:]) if len(rel.parts) > 1 else Path()
    if not rel.parts:
        return []
    root = shipped("configs")
    names = [rel] if rel.suffix else [rel.with_suffix(".yaml"), rel]
    return [root / name for name in names]


def find_config(text: str) -> Path | None:
    """`text` as the user gave it when that file exists (relative to the working directory), else the shipped
    file of that name, else None."""
    given = Path(text).expanduser()
    if given.is_file():
        return given
    for candidate in _shipped_candidates(text):
        if candidate.is_file():
            return candidate
    return None


def config_path(text: str | Path) -> Path:
    """`find_config`, else the path as given (reading it then fails naming it; add `NOT_FOUND`'s hint)."""
    return find_config(str(text)) or Path(text)


NOT_FOUND = "no such file here, nor a shipped config of that name; `trapo configs` lists those"


def shipped_configs() -> list[tuple[str, Path]]:
    """(name as `--config` takes it, path) of every shipped config file, the experiment YAMLs first."""
    root = shipped("configs")
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    top = [p for p in files if p.parent == root and p.suffix == ".yaml"]
    rest = [p for p in files if p not in top]
    return [
        (p.relative_to(root).with_suffix("").as_posix() if p in top else p.relative_to(root).as_posix(), p)
        for p in top + rest
    ]


def describe(path: Path) -> str:
    """A shipped file's one line: the first line of its leading comment, else its kind."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#!"):
            continue
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if text:
                return text
            continue
        break
    return {".json": "DeepSpeed config", ".sbatch": "Slurm batch script"}.get(path.suffix, "")
