"""Training files for the paper's runs, from local copies of the public datasets.

    python -m trapo prepare SOURCE... --labeled N --unlabeled M --out FILE
        [--unlabeled-from FILE...] [--split random|slices] [--seed S] [--exclude DIR...]
        [--tokenizer DIR --max-prompt-tokens T] [--template think|cot|chat]
    python -m trapo prepare --paper SOURCES_DIR      # every file the shipped paper configs name (make data)

A SOURCE is a parquet or JSONL file, or a folder of them (a dataset downloaded with
`huggingface-cli download --local-dir`). Its layout is detected from its columns:

- verl (LUFFY's Openr1-Math-46k-8192, LUFFY's valid.mmlu_pro): `prompt` + `reward_model.ground_truth`;
  the question is the last user message;
- OpenR1-Math-220k: `problem`, `answer`;
- DeepMath-103K: `question`, `final_answer`;
- MMLU-Pro: `question`, `options`, `answer` (a letter); options are listed "A) ..." as in our ARC-c/GPQA files;
- question/answer: `question`, `answer` (JSONL or parquet).

Cleaning, in this order, each counted in the manifest:
1. gold_unusable: an empty gold, one that Math-Verify cannot parse inside `\\boxed{}`, or one our
   answer extraction does not read back whole from `\\boxed{gold}` (it could never be matched);
2. duplicate: the same question after lower-casing and collapsing whitespace (the first is kept);
3. contaminated_exact / contaminated_ngram: the question of an evaluation set under `--exclude`
   (default: data/benchmarks), by exact match of its words, or by a shared run of NGRAM = 13 words
   (see `NGRAM` for why 13);
4. prompt_too_long: with `--tokenizer`, a prompt (rendered with `--template`, as the trainer renders it)
   over `--max-prompt-tokens` tokens.

Split: `random` (default) shuffles the kept rows with `--seed` and takes N labeled, then M unlabeled;
`slices` takes contiguous rows in file order, labeled first (the authors' public scripts slice LUFFY's
file so). With `--unlabeled-from`, the unlabeled rows come from those files instead (the paper's OOD
setting), cleaned the same way and never a question already labeled.

Output: a verl-layout parquet the trainer reads (`prompt` = the template's messages,
`reward_model.ground_truth`, `extra_info.labeled`, `extra_info.index` 0..N+M-1, `extra_info.question`
bare, `data_source`, `ability`), written atomically, and FILE.manifest.json beside it (sources with
sha256, options, counts). The same inputs and options give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trapo.data import REPO_BENCHMARKS, DataError, Question, jsonl_rows, parquet_rows, prompt_ids, template_messages

# Decontamination n-gram length, in words. Measured on the shipped evaluation sets (1590 distinct
# math questions; bench/bench_decontam.py prints the table): questions sharing an n-gram with a
# *different* question number 491 at n = 8 (stock phrasing such as "the final answer can be written in
# the form"), 324 at n = 10 and 246 at n = 13, after which the count flattens (224 at 16, 177 at 20):
# what two distinct questions still share at 13 words is mostly one problem's common statement
# (OlympiadBench's multi-part problems, Minerva's preambles), which a training question should not
# copy either. 13 is also the length of GPT-3's and lm-evaluation-harness's contamination checks;
# open-r1's script uses 8, which on these sets flags twice as many questions for shared boilerplate.
NGRAM = 13
TEMPLATES = ("think", "cot", "chat")
LAYOUTS = {
    "verl": ("prompt", "reward_model"),
    "deepmath": ("question", "final_answer"),
    "mmlu_pro": ("question", "options", "answer"),
    "openr1": ("problem", "answer"),
    "qa": ("question", "answer"),
}
REASONS = ("gold_unusable", "duplicate", "contaminated_exact", "contaminated_ngram", "prompt_too_long")


@dataclass(frozen=True)
class Row:
    question: str
    answer: str
    data_source: str
    ability: str
    where: str  # "file row N", for messages and provenance


# ----------------------------------------------------------------------------- reading sources


def source_files(spec: str) -> list[Path]:
    """A file, or every parquet/JSONL file under a folder (sorted, so the order is stable)."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl") and ".cache" not in p.parts)
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
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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
        ability = rec.get("ability") or ("general" if layout == "mmlu_pro" else "math")
        source = rec.get("data_source") or default_source
        rows.append(Row(question, "" if answer is None else str(answer).strip(), str(source), str(ability), where))
    return layout, rows


# ----------------------------------------------------------------------------- cleaning (pure but for the gold check)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def dedup_key(text: str) -> str:
    return " ".join(text.lower().split())


class Contamination:
    """Evaluation questions, by their word sequence and by every NGRAM-word window of it."""

    def __init__(self, questions: list[str], n: int = NGRAM):
        self.n = n
        self.exact = {" ".join(words(q)) for q in questions}
        self.grams = {g for q in questions for g in self._grams(words(q))}

    def _grams(self, w: list[str]) -> set[tuple[str, ...]]:
        return {tuple(w[i : i + self.n]) for i in range(len(w) - self.n + 1)}

    def check(self, question: str) -> str | None:
        """'contaminated_exact', 'contaminated_ngram' or None."""
        w = words(question)
        if " ".join(w) in self.exact:
            return "contaminated_exact"
        return "contaminated_ngram" if not self.grams.isdisjoint(self._grams(w)) else None

    @classmethod
    def from_dirs(cls, dirs: list[str]) -> tuple[Contamination, list[Path]]:
        files = []
        for d in dirs:
            path = Path(d)
            if not path.exists():
                raise DataError(f"--exclude {path}: not found (a folder of evaluation parquet/JSONL files)")
            files += source_files(d)
        questions = []
        for f in files:
            questions += [q.question for q in (parquet_rows(f) if f.suffix == ".parquet" else jsonl_rows(f))]
        return cls(questions), files


def _gold_check(gold: str) -> bool:
    from math_verify import parse

    from trapo.algorithm.rewards import extract_boxed

    boxed = "\\boxed{" + gold + "}"
    try:
        return extract_boxed(boxed) == gold and bool(parse(boxed, parsing_timeout=5))
    except Exception:  # noqa: BLE001 - Math-Verify raises many types on odd LaTeX; any of them means unusable
        return False


def usable_golds(golds: list[str], workers: int) -> list[bool]:
    """Each gold is non-empty and parses under Math-Verify as the reward parses it (in `\\boxed{}`)."""
    todo = sorted({g for g in golds if g.strip()})
    if workers > 1 and len(todo) > 2000:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            ok = dict(zip(todo, pool.map(_gold_check, todo, chunksize=256)))
    else:
        ok = {g: _gold_check(g) for g in todo}
    return [bool(g.strip()) and ok[g] for g in golds]


def clean(rows: list[Row], contamination: Contamination, too_long, counts: Counter, workers: int, seen: set[str]):
    """The rows that pass every check, in input order; `counts` gains one per dropped row and reason.

    `seen` holds the dedup keys already kept (shared between the labeled and the OOD pool);
    `too_long(row) -> bool` is the tokenizer check (or always False)."""
    ok_gold = usable_golds([r.answer for r in rows], workers)
    kept = []
    for row, good in zip(rows, ok_gold):
        key = dedup_key(row.question)
        reason = (
            "gold_unusable"
            if not good
            else "duplicate"
            if key in seen
            else contamination.check(row.question) or ("prompt_too_long" if too_long(row) else None)
        )
        if reason:
            counts[reason] += 1
            continue
        seen.add(key)
        kept.append(row)
    return kept


def take(rows: list[Row], n: int | None, split: str, rng: random.Random) -> tuple[list[Row], list[Row]]:
    """(the n rows taken, the rest) in `split` order; n None takes all."""
    order = list(rows)
    if split == "random":
        rng.shuffle(order)
    n = len(order) if n is None else n
    return order[:n], order[n:]


# ----------------------------------------------------------------------------- writing


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def table(labeled: list[Row], unlabeled: list[Row], template: str) -> pa.Table:
    rows = []
    for i, (row, is_labeled) in enumerate([(r, True) for r in labeled] + [(r, False) for r in unlabeled]):
        rows.append(
            {
                "data_source": row.data_source,
                "prompt": [{"role": r, "content": c} for r, c in template_messages(row.question, template)],
                "ability": row.ability,
                "reward_model": {"ground_truth": row.answer, "style": "rule"},
                "extra_info": {"index": i, "labeled": is_labeled, "question": row.question, "source": row.where},
            }
        )
    return pa.Table.from_pylist(rows)


def write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the command


def _count(text: str, flag: str) -> int | None:
    if text == "all":
        return None
    if not text.isdigit():
        raise DataError(f"{flag} {text!r}: expected a row count or 'all'")
    return int(text)


def prepare(args: argparse.Namespace, log=print) -> dict:
    """Check everything cheap first (paths, layouts, options), then clean, split, write; returns the manifest."""
    out = Path(args.out)
    if out.suffix != ".parquet":
        raise DataError(f"--out {out}: the training file must end in .parquet (the verl layout)")
    n_lab, n_unl = _count(args.labeled, "--labeled"), _count(args.unlabeled, "--unlabeled")
    if n_lab is None and n_unl is None:
        raise DataError("--labeled all and --unlabeled all: at most one of them can take the rest")
    if n_lab is None and n_unl and not args.unlabeled_from:
        raise DataError("--labeled all leaves no rows for --unlabeled; use --unlabeled 0 or --unlabeled-from")
    if args.tokenizer and not args.max_prompt_tokens:
        raise DataError("--tokenizer needs --max-prompt-tokens (the limit the prompts are checked against)")
    main_files = [f for s in args.sources for f in source_files(s)]
    pool_files = [f for s in args.unlabeled_from or [] for f in source_files(s)]
    layouts = {str(f): detect_layout(f) for f in main_files + pool_files}  # every layout error before any work
    contamination, excluded = Contamination.from_dirs(args.exclude)
    too_long = lambda row: False  # noqa: E731
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)

        def too_long(row: Row) -> bool:
            q = Question(row.where, row.question, row.answer, True, None, row.where)
            return len(prompt_ids(q, args.template, tokenizer)) > args.max_prompt_tokens

    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise DataError(f"--out {out}: folder {out.parent} is not writable")

    counts: Counter = Counter()
    seen: set[str] = set()
    read_main = [row for f in main_files for row in read_source(f)[1]]
    counts["read"] = len(read_main)
    kept = clean(read_main, contamination, too_long, counts, args.workers, seen)
    rng = random.Random(f"trapo.commands.prepare-{args.seed}")
    labeled, rest = take(kept, n_lab, args.split, rng)
    if pool_files:
        read_pool = [row for f in pool_files for row in read_source(f)[1]]
        counts["read_unlabeled_from"] = len(read_pool)
        # The labeled questions are the ones that must not come back; the unused main rows may.
        seen = {dedup_key(r.question) for r in labeled}
        pool_counts: Counter = Counter()
        rest = clean(read_pool, contamination, too_long, pool_counts, args.workers, seen)
        counts.update({f"{k}_unlabeled_from": v for k, v in pool_counts.items()})
        if args.split == "random":
            rng.shuffle(rest)
    unlabeled = rest if n_unl is None else rest[:n_unl]
    want_lab = len(kept) if n_lab is None else n_lab
    if len(labeled) < want_lab or (n_unl is not None and len(unlabeled) < n_unl):
        dropped = ", ".join(f"{counts[r]} {r}" for r in REASONS if counts[r])
        have = f"{len(kept)} rows remain of {counts['read']} read ({dropped or 'none dropped'})"
        if pool_files:
            have += f"; the --unlabeled-from pool has {len(rest)} after cleaning"
        raise DataError(f"asked for {args.labeled} labeled + {args.unlabeled} unlabeled rows, but {have}")

    write_atomic(out, lambda tmp: pq.write_table(table(labeled, unlabeled, args.template), tmp))
    counts.update(kept=len(kept), labeled=len(labeled), unlabeled=len(unlabeled))
    manifest = {
        "output": out.name,
        "output_sha256": sha256(out),
        "command": "python -m trapo prepare " + " ".join(args.argv),
        "options": {
            "labeled": args.labeled,
            "unlabeled": args.unlabeled,
            "split": args.split,
            "seed": args.seed,
            "template": args.template,
            "tokenizer": args.tokenizer,
            "max_prompt_tokens": args.max_prompt_tokens if args.tokenizer else None,
            "ngram": NGRAM,
        },
        "sources": [{"path": str(f), "sha256": sha256(f), "layout": layouts[str(f)]} for f in main_files],
        "unlabeled_from": [{"path": str(f), "sha256": sha256(f), "layout": layouts[str(f)]} for f in pool_files],
        "exclude": [{"path": str(f), "sha256": sha256(f)} for f in excluded],
        "counts": dict(sorted(counts.items())),
    }
    write_atomic(
        Path(f"{out}.manifest.json"), lambda tmp: tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    )
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k.split("_unlabeled_from")[0] in REASONS)
    log(f"{out}: {len(labeled)} labeled + {len(unlabeled)} unlabeled of {counts['read']} read")
    log(f"  dropped: {dropped or 'none'}; manifest: {out}.manifest.json")
    return manifest


# The training file each shipped paper config names, from the folders `make data SOURCES=dir` expects
# (README, "Reproducing the paper on GPUs", lists the download command of each). OpenR1 files follow
# the authors' public scripts: contiguous slices of LUFFY's 46k file, 1K = 1024 rows, labeled first;
# the OOD pool is LUFFY's MMLU-Pro file. DeepMath has no public script: a seeded random draw, as its
# appendix describes ("randomly select 2K ... and 8K").
PAPER_FILES = {
    "openr1_1k_labeled_3k_unlabeled.parquet": ["openr1-46k", "--labeled", "1024", "--unlabeled", "3072"],
    "openr1_4k_labeled_12k_unlabeled.parquet": ["openr1-46k", "--labeled", "4096", "--unlabeled", "12288"],
    "openr1_45k.parquet": ["openr1-46k", "--labeled", "all", "--unlabeled", "0"],
    "math_1k_labeled_ood_1k_unlabeled.parquet": ["openr1-46k", "--labeled", "1024", "--unlabeled", "1024"]
    + ["--unlabeled-from", "mmlu-pro"],
    "deepmath_2k_labeled_8k_unlabeled.parquet": ["deepmath-103k", "--labeled", "2000", "--unlabeled", "8000"]
    + ["--split", "random"],
}


def paper_commands(sources: Path, out_dir: Path, extra: list[str]) -> list[list[str]]:
    """The argv of each paper file: folder names resolved under `sources`, slices unless said otherwise."""
    commands = []
    for name, spec in PAPER_FILES.items():
        argv = [str(sources / spec[0])] + [
            str(sources / a) if spec[i - 1] == "--unlabeled-from" else a for i, a in enumerate(spec[1:], 1)
        ]
        if "--split" not in argv:
            argv += ["--split", "slices"]
        commands.append(argv + ["--out", str(out_dir / name)] + extra)
    return commands


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trapo prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("sources", nargs="*", metavar="SOURCE", help="parquet/JSONL files or folders")
    p.add_argument("--labeled", default="0", help="labeled rows (a count or 'all')")
    p.add_argument("--unlabeled", default="0", help="unlabeled rows (a count or 'all')")
    p.add_argument("--out", help="the training file (.parquet); FILE.manifest.json goes beside it")
    p.add_argument("--unlabeled-from", nargs="+", metavar="FILE", help="take the unlabeled rows from these")
    p.add_argument("--split", choices=["random", "slices"], default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", nargs="+", default=[str(REPO_BENCHMARKS)], metavar="DIR", help="evaluation sets")
    p.add_argument("--tokenizer", help="model dir whose tokenizer measures prompts")
    p.add_argument("--max-prompt-tokens", type=int, help="drop prompts longer than this (needs --tokenizer)")
    p.add_argument("--template", choices=TEMPLATES, default="think", help="the stored prompt (default: think)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes for the gold check")
    p.add_argument("--paper", metavar="SOURCES_DIR", help="write every training file of the shipped paper configs")
    p.add_argument("--out-dir", default="data", help="with --paper: where the files go (default: data)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    try:
        if args.paper:
            sources = Path(args.paper)
            extra = ["--seed", str(args.seed), "--template", args.template, "--workers", str(args.workers)]
            extra += ["--exclude", *args.exclude]
            if args.tokenizer:
                extra += ["--tokenizer", args.tokenizer, "--max-prompt-tokens", str(args.max_prompt_tokens or 0)]
            for cmd in paper_commands(sources, Path(args.out_dir), extra):
                if not Path(cmd[0]).exists():
                    raise DataError(f"{cmd[0]}: not found; download it first (README, 'Reproducing the paper')")
            for cmd in paper_commands(sources, Path(args.out_dir), extra):
                sub = p.parse_args(cmd)
                sub.argv = cmd
                prepare(sub)
            return 0
        if not args.sources or not args.out:
            p.error("give SOURCE... and --out (or --paper SOURCES_DIR)")
        args.argv = argv
        prepare(args)
        return 0
    except DataError as err:
        print(f"trapo prepare: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
