"""Reading prepare's sources: a parquet or JSONL file, a folder of them, or a Hugging Face dataset id
(downloaded into the hub cache, parquet and JSONL files only; trapo/hub.py). Each file's layout is
detected from its columns (`LAYOUTS`), and every row becomes a `Row`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from trapo import hub
from trapo.data import DataError, not_utf8, parquet_not_utf8, valid_unicode

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
    where: str  # "file row N" (parquet, 0-based) or "file line N" (JSONL, 1-based), for messages and provenance


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
    first = next(_jsonl_lines(path), None)
    row = _json(path, *first) if first else {}
    return list(row) if isinstance(row, dict) else []


def detect_layout(path: Path) -> str:
    cols = _columns(path)
    for name, needed in LAYOUTS.items():
        if all(c in cols for c in needed):
            return name
    accepted = "; ".join(f"{name}: {', '.join(needed)}" for name, needed in LAYOUTS.items())
    raise DataError(f"{path}: columns {', '.join(cols) or '(none)'} match no known layout (accepted: {accepted})")


def _records(path: Path, columns: tuple[str, ...]) -> list[tuple[str, object]]:
    """("row N" of a parquet file, 0-based as pyarrow counts, or "line N" of a JSONL file, 1-based as an
    editor counts, each as training names it; the record) of every row."""
    if path.suffix == ".parquet":
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in columns if c in names])
        try:
            records = table.to_pylist()
        except UnicodeDecodeError:  # named by row and field, as training names it
            raise parquet_not_utf8(path, table) from None
        return [(f"row {i}", rec) for i, rec in enumerate(records)]
    return [(f"line {n}", _json(path, n, line)) for n, line in _jsonl_lines(path)]


def _jsonl_lines(path: Path):
    """(1-based line number, text) of each non-blank line, read lazily, one line decoded at a time: a byte that
    is not UTF-8 is named by its line, as training names a JSONL row (trapo/data.py)."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise not_utf8(path, n, raw, err.start) from None
                if line.strip():
                    yield n, line
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror})") from None


def _json(path: Path, n: int, line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path} line {n}: not valid JSON ({err.msg}, column {err.colno})") from None


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
    for place, rec in _records(path, (question_col, answer_col, "options", "data_source", "ability")):
        where = f"{path} {place}"
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
