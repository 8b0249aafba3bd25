"""Training files for the paper's runs, from the public datasets (local copies or hub ids).

    python -m trapo prepare SOURCE... --labeled N --unlabeled M --out FILE
        [--unlabeled-from SOURCE...] [--split random|slices] [--seed S] [--exclude DIR...]
        [--tokenizer DIR|ID --max-prompt-tokens T] [--template think|cot|chat | --prompt FILE] [--no-progress]
    python -m trapo prepare --paper SOURCES_DIR      # every file the shipped paper configs name (make data)

A SOURCE is a parquet or JSONL file, a folder of them (a dataset downloaded with
`hf download --repo-type dataset --local-dir`), or a hub dataset id `org/name[@revision]`, downloaded
into the hub cache (parquet and JSONL files only; HF_HUB_OFFLINE=1 reads the cache alone). Its layout is
detected from its columns:

- verl (LUFFY's Openr1-Math-46k-8192, LUFFY's valid.mmlu_pro): `prompt` + `reward_model.ground_truth`;
  the question is the last user message;
- OpenR1-Math-220k: `problem`, `answer`;
- DeepMath-103K: `question`, `final_answer`;
- MMLU-Pro: `question`, `options`, `answer` (a letter); options are listed "A) ..." as in our ARC-c/GPQA files;
- question/answer: `question`, `answer` (JSONL or parquet).

Cleaning, in this order, each counted in the manifest:
1. gold_unusable: an empty gold, prose (three words in a row, "see the solution above": trapo.data's
   `gold_problem`, the check the trainer applies to labeled rows), one that Math-Verify cannot parse inside
   `\\boxed{}`, or one our answer extraction does not read back whole from `\\boxed{gold}` (it could never
   be matched);
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

Output: a verl-layout parquet the trainer reads (`prompt` = the template's messages, or with `--prompt FILE`
the messages of that JSON file, a list of {"role", "content"} whose last user turn holds `{question}` once:
a system turn and worked examples, read by `data.prompt_template: dataset`;
`reward_model.ground_truth`, `extra_info.labeled`, `extra_info.index` 0..N+M-1, `extra_info.question`
bare, `data_source`, `ability`), written atomically, and FILE.manifest.json beside it (sources with
sha256 and, from the hub, `org/name@commit`; options; counts). The same inputs and options give the
same bytes. One progress bar per source file (golds checked, then rows), off with --no-progress or when
the terminal is no tty.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trapo import console, hub
from trapo.commands.prepare.cleaning import NGRAM, REASONS, Contamination, clean, dedup_key
from trapo.commands.prepare.sources import Row, detect_layout, files_under, read_source, resolve_source
from trapo.config import ConfigError
from trapo.data import REPO_BENCHMARKS, DataError, Question, prompt_ids, template_messages

TEMPLATES = ("think", "cot", "chat")


def take(rows: list[Row], n: int | None, split: str, rng: random.Random) -> tuple[list[Row], list[Row]]:
    """(the n rows taken, the rest) in `split` order; n None takes all."""
    order = list(rows)
    if split == "random":
        rng.shuffle(order)
    n = len(order) if n is None else n
    return order[:n], order[n:]


# ----------------------------------------------------------------------------- writing


def read_prompt(path: Path) -> list[tuple[str, str]]:
    """A `--prompt` file's messages: a JSON list of {"role", "content"}, the last a user turn with `{question}`
    (where each question goes) exactly once; anything else is an error naming the file and the fix."""
    try:
        messages = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"--prompt {path}: cannot read it as JSON ({err})") from None
    fix = 'a JSON list of {"role": "system"|"user"|"assistant", "content": "..."}'
    if not isinstance(messages, list) or not messages:
        raise DataError(f"--prompt {path}: expected {fix}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise DataError(f"--prompt {path}: message {i} is not {fix}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"--prompt {path}: message {i} has no string 'content'")
        out.append((m["role"], m["content"]))
    if out[-1][0] != "user" or out[-1][1].count("{question}") != 1:
        raise DataError(f"--prompt {path}: the last message must be a user turn holding {{question}} exactly once")
    if any("{question}" in c for _, c in out[:-1]):
        raise DataError(f"--prompt {path}: only the last message may hold {{question}}")
    return out


def prompt_messages(question: str, template: str, prompt: list[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """The stored messages of one question: `--prompt`'s with the question in, else the template's."""
    if prompt is None:
        return template_messages(question, template)
    return [(r, c.replace("{question}", question)) for r, c in prompt]


def table(labeled: list[Row], unlabeled: list[Row], template: str, prompt=None) -> pa.Table:
    rows = []
    for i, (row, is_labeled) in enumerate([(r, True) for r in labeled] + [(r, False) for r in unlabeled]):
        rows.append(
            {
                "data_source": row.data_source,
                "prompt": [{"role": r, "content": c} for r, c in prompt_messages(row.question, template, prompt)],
                "ability": row.ability,
                "reward_model": {"ground_truth": row.answer, "style": "rule"},
                "extra_info": {"index": i, "labeled": is_labeled, "question": row.question, "source": row.where},
            }
        )
    return pa.Table.from_pylist(rows)


def source_record(f: Path, layouts: dict, hub_of: dict) -> dict:
    """A source file in the manifest: path, sha256, layout, and the hub dataset and commit it came from."""
    record = {"path": str(f), "sha256": hub.file_sha256(f), "layout": layouts[str(f)]}
    return {**record, "hub": hub_of[str(f)]} if str(f) in hub_of else record


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
    # each SOURCE resolved once (a hub id: fetched once): its files, and its `org/name@commit` when from the hub
    resolved = {spec: resolve_source(spec) for spec in [*args.sources, *(args.unlabeled_from or [])]}
    files = {spec: files_under(path) for spec, (path, _) in resolved.items()}
    main_files = [f for s in args.sources for f in files[s]]
    pool_files = [f for s in args.unlabeled_from or [] for f in files[s]]
    hub_of = {str(f): label for s, (_, label) in resolved.items() if label for f in files[s]}
    layouts = {str(f): detect_layout(f) for f in main_files + pool_files}  # every layout error before any work
    contamination, excluded = Contamination.from_dirs(args.exclude)
    prompt = read_prompt(Path(args.prompt)) if getattr(args, "prompt", None) else None
    too_long = lambda row: False  # noqa: E731
    tokenizer_source = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer_source = hub.fetch(args.tokenizer, kind="tokenizer", what="--tokenizer")  # a dir or a hub id
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source.local_dir)

        def too_long(row: Row) -> bool:
            messages = tuple(prompt_messages(row.question, args.template, prompt))
            q = Question(row.where, row.question, row.answer, True, messages, row.where)
            return len(prompt_ids(q, "dataset", tokenizer)) > args.max_prompt_tokens

    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise DataError(f"--out {out}: folder {out.parent} is not writable")

    counts: Counter = Counter()
    seen: set[str] = set()
    show = not getattr(args, "no_progress", False)

    def clean_each(files: list[Path], counts: Counter, seen: set[str]) -> tuple[int, list[Row]]:
        """(rows read, rows kept) over `files` in order, one progress bar per file (cleaning file by file
        keeps what one pass over all rows keeps: `seen` carries the duplicates across files)."""
        read, kept = 0, []
        for f in files:
            rows = read_source(f)[1]
            read += len(rows)
            with console.progress_bar(len(rows), f"{f.name}: rows", show, unit="row") as bar:
                kept += clean(rows, contamination, too_long, counts, args.workers, seen, bar)
        return read, kept

    counts["read"], kept = clean_each(main_files, counts, seen)
    rng = random.Random(f"trapo.commands.prepare-{args.seed}")
    labeled, rest = take(kept, n_lab, args.split, rng)
    if pool_files:
        # The labeled questions are the ones that must not come back; the unused main rows may.
        seen = {dedup_key(r.question) for r in labeled}
        pool_counts: Counter = Counter()
        counts["read_unlabeled_from"], rest = clean_each(pool_files, pool_counts, seen)
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

    write_atomic(out, lambda tmp: pq.write_table(table(labeled, unlabeled, args.template, prompt), tmp))
    counts.update(kept=len(kept), labeled=len(labeled), unlabeled=len(unlabeled))
    manifest = {
        "output": out.name,
        "output_sha256": hub.file_sha256(out),
        "command": "python -m trapo prepare " + " ".join(args.argv),
        "options": {
            "labeled": args.labeled,
            "unlabeled": args.unlabeled,
            "split": args.split,
            "seed": args.seed,
            "template": args.template if prompt is None else None,
            "prompt": {"path": args.prompt, "sha256": hub.file_sha256(Path(args.prompt))} if prompt else None,
            "tokenizer": tokenizer_source.label if tokenizer_source else None,  # a hub id with its commit
            "max_prompt_tokens": args.max_prompt_tokens if args.tokenizer else None,
            "ngram": NGRAM,
        },
        "sources": [source_record(f, layouts, hub_of) for f in main_files],
        "unlabeled_from": [source_record(f, layouts, hub_of) for f in pool_files],
        "exclude": [{"path": str(f), "sha256": hub.file_sha256(f)} for f in excluded],
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
    p.add_argument("sources", nargs="*", metavar="SOURCE", help="parquet/JSONL files, folders, or org/name[@rev]")
    p.add_argument("--labeled", default="0", help="labeled rows (a count or 'all')")
    p.add_argument("--unlabeled", default="0", help="unlabeled rows (a count or 'all')")
    p.add_argument("--out", help="the training file (.parquet); FILE.manifest.json goes beside it")
    p.add_argument("--unlabeled-from", nargs="+", metavar="FILE", help="take the unlabeled rows from these")
    p.add_argument("--split", choices=["random", "slices"], default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", nargs="+", default=[str(REPO_BENCHMARKS)], metavar="DIR", help="evaluation sets")
    p.add_argument("--tokenizer", help="model dir or hub id whose tokenizer measures prompts")
    p.add_argument("--max-prompt-tokens", type=int, help="drop prompts longer than this (needs --tokenizer)")
    p.add_argument("--template", choices=TEMPLATES, default="think", help="the stored prompt (default: think)")
    p.add_argument("--prompt", metavar="FILE", help="the stored messages: a JSON chat with {question} (not --template)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes for the gold check")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (also off when not a terminal)")
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
    except (DataError, ConfigError) as err:  # ConfigError: a hub id that cannot be had (trapo/hub.py)
        print(f"trapo prepare: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
