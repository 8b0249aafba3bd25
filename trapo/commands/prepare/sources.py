"""Reading prepare's sources: a parquet or JSONL file, a folder of them, or a Hugging Face dataset id
(downloaded into the hub cache, parquet and JSONL files only; trapo/hub.py). Each file's layout is
detected from its columns (`LAYOUTS`), and every row becomes a `Row`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from trapo import hub
from trapo.data import DataError, valid_unicode

LAYOUTS = {
    "verl": ("prompt", "reward_model"),
    "deepmath": ("question", "final_answer"),
    "mmlu_pro": ("question", "options", "answer"),
    "openr1": ("problem", "answer"),
    "qa": ("question", "answer"),
}


@dataclass(frozen=True)
class Row:
    question: str
    answer: str
    data_source: str
    ability: str
    where: str  # "file row N", for messages and provenance


def resolve_source(spec: str) -> tuple[Path, str | None]:
    """(the local path, `org/name@commit` or None) of a SOURCE: a file or folder, or a dataset id
    `org/name[@revision]` downloaded into the hub cache (parquet and JSONL files only)."""
    if Path(spec).exists():
        return Path(spec), None
    name, _, revision = spec.partition("@")
    if Path(name).suffix in (".parquet", ".jsonl") or not hub.is_hub_id(name):  # a file that is not there
        raise DataError(
            f"{spec}: source not found (a parquet or JSONL file, a folder of them, or a dataset id org/name[@revision])"
        )
    snap = hub.fetch(name, revision or None, kind="dataset", what="SOURCE")
    return snap.local_dir, snap.label


def source_files(spec: str) -> list[Path]:
    """A file, or every parquet/JSONL file under a folder or a hub dataset's snapshot (sorted: a stable order)."""
    return files_under(resolve_source(spec)[0])


def files_under(path: Path) -> list[Path]:
    """`path` itself when a file, else every parquet/JSONL file under it (sorted: a stable order)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in (".parquet", ".jsonl") and ".cache" not in p.relative_to(path).parts
        )
        if not files:
            raise DataError(f"{path}: no .parquet or .jsonl files in this folder")
        return files
    raise DataError(f"{path}: source not found (a parquet or JSONL file, or a folder of them)")


def _columns(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        try:
            return list(pq.read_schema(path).names)
        except Exception as err:  # noqa: BLE001 - pyarrow raises many types; all mean "not a readable parquet"
            raise DataError(f"{path}: cannot read as parquet ({err})") from None
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "{}")
        row = json.loads(first)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read the first JSONL row ({err})") from None
    return list(row) if isinstance(row, dict) else []


def detect_layout(path: Path) -> str:
    cols = _columns(path)
    for name, needed in LAYOUTS.items():
        if all(c in cols for c in needed):
            return name
    accepted = "; ".join(f"{name}: {', '.join(needed)}" for name, needed in LAYOUTS.items())
    raise DataError(f"{path}: columns {', '.join(cols) or '(none)'} match no known layout (accepted: {accepted})")


def _records(path: Path, columns: tuple[str, ...]) -> list[dict]:
    if path.suffix == ".parquet":
        names = pq.read_schema(path).names
        return pq.read_table(path, columns=[c for c in columns if c in names]).to_pylist()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}); re-encode it as UTF-8") from None
    records = []
    for i, line in enumerate(lines):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {i + 1}: not valid JSON ({err.msg}, column {err.colno})") from None
    return records


def _choices(options) -> str:
    return "\n".join(f"{chr(ord('A') + i)}) {o}" for i, o in enumerate(options))


def _last_user(prompt, where: str) -> str:
    users = [m.get("content") for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise DataError(f"{where}: field 'prompt' has no user message (the question)")
    return users[-1]


def read_source(path: Path) -> tuple[str, list[Row]]:
    """(layout, rows) of one file; a missing gold becomes "" (dropped by the cleaning, and counted)."""
    layout = detect_layout(path)
    if layout == "verl" and path.suffix != ".parquet":
        raise DataError(f"{path}: a verl-layout file (prompt, reward_model) must be parquet")
    question_col, answer_col = {
        "verl": ("prompt", "reward_model"),
        "deepmath": ("question", "final_answer"),
        "openr1": ("problem", "answer"),
    }.get(layout, ("question", "answer"))
    default_source = path.stem if layout in ("verl", "qa") else layout
    rows = []
    for i, rec in enumerate(_records(path, (question_col, answer_col, "options", "data_source", "ability"))):
        where = f"{path} row {i}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected an object with '{question_col}' and '{answer_col}'")
        question, answer = rec.get(question_col), rec.get(answer_col)
        if layout == "verl":
            question = _last_user(question, where)
            answer = answer.get("ground_truth") if isinstance(answer, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where}: field '{question_col}' must be a non-empty string")
        if layout == "mmlu_pro":
            question = f"{question.strip()}\n\n{_choices(rec.get('options') or [])}"
        question = valid_unicode(question, where, question_col)
        if isinstance(answer, str):
            answer = valid_unicode(answer, where, answer_col)
        ability = rec.get("ability") or ("general" if layout == "mmlu_pro" else "math")
        source = rec.get("data_source") or default_source
        rows.append(Row(question, "" if answer is None else str(answer).strip(), str(source), str(ability), where))
    return layout, rows
