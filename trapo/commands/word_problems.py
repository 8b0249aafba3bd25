"""Arithmetic word problems with exact golds: the real-model task (`make train-real`, docs/real-model.md).

    trapo word-problems [--out DIR] [--seed S] [--train N --labeled L --validation V --test T --ood O]

A problem is a short story about one kind of object, told in one to three arithmetic steps:
a start ("Mia has 14 shells." or "Mia buys 3 bags of shells with 6 shells in each bag.", which is
a multiplication), then steps that add, take away or multiply, and a question, which may end in a fair
share (a division with no remainder). Every number and every intermediate value is a whole number >= 0.

`problems(seed, n, steps, range_name)` draws `n` distinct problems whose operands lie in RANGES[range_name]
(box counts, multipliers and shares stay below 10); the same arguments give the same problems.
`Problem.steps` is the number of operations, the task's difficulty knob; `range` names the operands' range.

The command writes the splits through `trapo prepare` (its cleaning, decontamination against the shipped
benchmarks, and manifest), as the paper's runs' files are written: `train.parquet` (`--labeled` of its
questions labeled, the rest unlabeled with their golds kept hidden, for diagnostics only), and
`validation.parquet`, `test.parquet` and `test_ood.parquet` (every row labeled), each with its
`.manifest.json`, every row's prompt the messages of `PROMPT`. `problems.jsonl` records each question's split,
steps and range (for per-difficulty reports). Written into a scratch folder and renamed into place: a folder
that is there is complete, and a second call with the same arguments returns at once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

NAMES = ["Mia", "Leo", "Ava", "Sam", "Nora", "Omar", "Lily", "Ben", "Zoe", "Raj", "Ella", "Tom", "Ines", "Kai"]
FRIENDS = ["a friend", "a neighbour", "the teacher", "a classmate", "Grandma", "the coach"]
# (plural noun, container) pairs: the container holds the objects in a multiplication start.
OBJECTS = [
    ("apples", "bags"),
    ("pencils", "boxes"),
    ("stickers", "sheets"),
    ("marbles", "jars"),
    ("cookies", "trays"),
    ("shells", "buckets"),
    ("cards", "packs"),
    ("eggs", "cartons"),
    ("books", "shelves"),
    ("beads", "strings"),
]

# Each phrasing is filled with: {who} the name, {n} the operand, {things} the objects, {box} the container,
# {friend} another person. Several per operation, so a model cannot key on one sentence.
STARTS = ["{who} has {n} {things}.", "{who} starts with {n} {things}.", "There are {n} {things} in {who}'s room."]
BOX_STARTS = [
    "{who} buys {a} {box} of {things} with {b} {things} in each.",
    "{who} has {a} {box}, and each holds {b} {things}.",
    "{who} fills {a} {box} with {b} {things} each.",
]
ADDS = [
    "{who} buys {n} more {things}.",
    "{friend} gives {who} {n} more {things}.",
    "Then {who} finds {n} more {things}.",
]
TAKES = ["{who} gives {n} {things} to {friend}.", "{who} loses {n} of them.", "Then {who} uses {n} {things}."]
TIMES = ["{who} then gets {n} times as many {things} as before.", "The number of {things} grows {n} times over."]
QUESTIONS = [
    "How many {things} does {who} have now?",
    "How many {things} are there in the end?",
    "What is the number of {things} now?",
]
SHARES = [
    "{who} shares them equally among {n} friends. How many {things} does each friend get?",
    "{who} puts them into {n} equal piles. How many {things} are in each pile?",
]
RANGES = {"tiny": (2, 9), "small": (2, 20), "medium": (10, 99), "large": (100, 999)}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    steps: int  # arithmetic operations in the solution
    range: str  # the operands' range, a key of RANGES


def _story(rng: random.Random, steps: int, lo: int, hi: int) -> tuple[str, int] | None:
    """One problem of `steps` operations with operands in [lo, hi], or None when a draw breaks a rule
    (a negative count, a share with a remainder); the caller draws again."""
    who, friend = rng.choice(NAMES), rng.choice(FRIENDS)
    things, box = rng.choice(OBJECTS)
    fill = dict(who=who, friend=friend, things=things, box=box)
    small = (2, min(9, hi))  # multipliers, box counts and shares stay small: a count, not an operand range
    sentences, ops = [], steps
    if ops >= 1 and rng.random() < 0.35:  # a multiplication start counts as one step
        a, b = rng.randint(*small), rng.randint(lo, hi)
        sentences.append(rng.choice(BOX_STARTS).format(a=a, b=b, **fill))
        value, ops = a * b, ops - 1
    else:
        value = rng.randint(lo, hi)
        sentences.append(rng.choice(STARTS).format(n=value, **fill))
    share = ops >= 1 and rng.random() < 0.3  # the last step a fair share
    for _ in range(ops - 1 if share else ops):
        kind = rng.choices(["add", "take", "times"], weights=[4, 4, 1])[0]
        if kind == "times" and value * small[1] <= 10 * hi:
            n = rng.randint(*small)
            sentences.append(rng.choice(TIMES).format(n=n, **fill))
            value *= n
        elif kind == "take" and value > lo:
            n = rng.randint(lo, min(hi, value - 1))
            sentences.append(rng.choice(TAKES).format(n=n, **fill))
            value -= n
        else:
            n = rng.randint(lo, hi)
            sentences.append(rng.choice(ADDS).format(n=n, **fill))
            value += n
    if share:
        divisors = [d for d in range(2, 10) if value % d == 0 and value // d > 1]
        if not divisors:
            return None
        n = rng.choice(divisors)
        sentences.append(rng.choice(SHARES).format(n=n, **fill))
        value //= n
    else:
        sentences.append(rng.choice(QUESTIONS).format(**fill))
    return " ".join(s[0].upper() + s[1:] for s in sentences), value


def problems(seed: int, n: int, steps: int, range_name: str) -> list[Problem]:
    """`n` distinct problems of `steps` operations with operands in RANGES[range_name]; deterministic in its
    arguments."""
    lo, hi = RANGES[range_name]
    rng = random.Random(f"word-problems-{seed}-{steps}-{range_name}")
    out: dict[str, Problem] = {}
    for _ in range(200 * n):
        if len(out) == n:
            return list(out.values())
        drawn = _story(rng, steps, lo, hi)
        if drawn is not None and drawn[0] not in out:
            out[drawn[0]] = Problem(drawn[0], drawn[1], steps, range_name)
    raise ValueError(f"only {len(out)} distinct {steps}-step problems in range {range_name} of {n} asked")


# ----------------------------------------------------------------------------- the splits

# The prompt every split stores (prepare --prompt): a system turn asking for one line per step and a boxed
# answer, and two worked examples in that form, one of two steps and one fair share. Measured on
# SmolLM2-135M-Instruct (docs/real-model.md): without examples it answers in prose and rarely boxes.
PROMPT = [
    {
        "role": "system",
        "content": "You solve math word problems. Write the arithmetic in one short line per step, "
        "then the final answer as \\boxed{number}.",
    },
    {
        "role": "user",
        "content": "Mia buys 3 bags of shells with 6 shells in each. She gives 5 shells to a friend. "
        "How many shells does Mia have now?",
    },
    {"role": "assistant", "content": "3 * 6 = 18\n18 - 5 = 13\n\\boxed{13}"},
    {
        "role": "user",
        "content": "Leo has 20 cards. He shares them equally among 4 friends. How many cards does each friend get?",
    },
    {"role": "assistant", "content": "20 / 4 = 5\n\\boxed{5}"},
    {"role": "user", "content": "{question}"},
]
# Each split's mix: (steps, range) -> share of its questions. In-domain splits share one mix; the
# out-of-domain split has numbers outside the training range.
IN_DOMAIN = {(1, "tiny"): 0.3, (1, "small"): 0.3, (2, "tiny"): 0.15, (2, "small"): 0.15, (3, "tiny"): 0.1}
OUT_OF_DOMAIN = {(1, "medium"): 0.7, (2, "medium"): 0.3}


def counts(mix: dict[tuple[int, str], float], n: int) -> dict[tuple[int, str], int]:
    """`n` split over the mix's cells by largest remainder (the counts sum to n)."""
    raw = {cell: share * n for cell, share in mix.items()}
    out = {cell: int(x) for cell, x in raw.items()}
    for cell in sorted(raw, key=lambda c: out[c] - raw[c])[: n - sum(out.values())]:
        out[cell] += 1
    return out


def splits(seed: int, sizes: dict[str, int]) -> dict[str, list[Problem]]:
    """Disjoint splits {train, validation, test, test_ood} of the given sizes, each in its mix, shuffled."""
    wanted = {name: counts(OUT_OF_DOMAIN if name == "test_ood" else IN_DOMAIN, n) for name, n in sizes.items()}
    out: dict[str, list[Problem]] = {name: [] for name in sizes}
    for cell in dict.fromkeys(c for w in wanted.values() for c in w):
        pool = problems(seed, sum(w.get(cell, 0) for w in wanted.values()), *cell)
        for name, w in wanted.items():  # dealt out in a fixed order: no question in two splits
            out[name] += pool[: w.get(cell, 0)]
            pool = pool[w.get(cell, 0) :]
    for name in out:
        random.Random(f"word-problems-order-{seed}-{name}").shuffle(out[name])
    return out


# ----------------------------------------------------------------------------- the command

# 2: "buys N more" names its objects (after a box start it could have meant N more boxes)
FORMAT = 2
SIZES = {"train": 64, "validation": 32, "test": 64, "test_ood": 64}
LABELED = 16  # a quarter of the training questions


def build(out: Path, seed: int, sizes: dict[str, int], labeled: int, log=print) -> Path:
    """The splits as verl-layout parquet files under `out` (made unless a complete one with the same options
    is there); returns `out`."""
    from trapo.commands import prepare

    options = {"format": FORMAT, "seed": seed, "sizes": sizes, "labeled": labeled, "prompt": PROMPT}
    record = out / "word_problems.json"
    if record.is_file():
        if json.loads(record.read_text()).get("options") == options:
            log(f"{out}: ready")
            return out
        raise prepare.DataError(f"{out}: holds word problems made with other options; remove it or choose --out")
    if not 0 < labeled < sizes["train"]:
        raise prepare.DataError(f"--labeled {labeled}: must be between 1 and --train - 1 ({sizes['train'] - 1})")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        drawn = splits(seed, sizes)
        (scratch / "prompt.json").write_text(json.dumps(PROMPT, indent=1) + "\n")
        (scratch / "sources").mkdir()
        with open(scratch / "problems.jsonl", "w") as f:
            for name, rows in drawn.items():
                source = scratch / "sources" / f"{name}.jsonl"
                source.write_text(
                    "".join(json.dumps({"question": p.question, "answer": str(p.answer)}) + "\n" for p in rows)
                )
                f.writelines(json.dumps({"split": name, **asdict(p)}) + "\n" for p in rows)
                if name == "train":
                    counts_args = ["--labeled", str(labeled), "--unlabeled", "all"]
                else:
                    counts_args = ["--labeled", "all", "--unlabeled", "0"]
                argv = [str(source), *counts_args, "--out", str(scratch / f"{name}.parquet"), "--seed", str(seed)]
                argv += ["--prompt", str(scratch / "prompt.json"), "--workers", "1", "--no-progress"]
                args = prepare.parser().parse_args(argv)
                args.argv = argv  # its scratch paths become `out` below, in every manifest
                manifest = prepare.prepare(args, log=lambda line: None)
                if manifest["counts"]["kept"] != len(rows):
                    dropped = {k: v for k, v in manifest["counts"].items() if k not in ("read", "kept")}
                    raise prepare.DataError(f"{name}: trapo prepare dropped questions ({dropped})")
        for manifest_file in scratch.glob("*.manifest.json"):  # name the files where they end up, not the scratch
            manifest_file.write_text(manifest_file.read_text().replace(str(scratch), str(out)))
        os.chmod(scratch, 0o755)  # mkdtemp's folder is private; the data is not
        record_tmp = scratch / "word_problems.json"
        record_tmp.write_text(json.dumps({"options": options, "splits": {k: len(v) for k, v in drawn.items()}}) + "\n")
        os.replace(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(
        f"{out}: {sizes['train']} training questions ({labeled} labeled), "
        + ", ".join(f"{sizes[k]} {k}" for k in ("validation", "test", "test_ood"))
    )
    return out


def main(argv: list[str] | None = None) -> int:
    from trapo import console
    from trapo.data import DataError

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the splits' folder (default: outputs/word-problems/seed-S)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--labeled", type=int, default=LABELED, help=f"labeled training questions ({LABELED})")
    for name, n in SIZES.items():
        flag = "ood" if name == "test_ood" else name
        parser.add_argument(f"--{flag}", type=int, default=n, dest=name, help=f"questions ({n})")
    args = parser.parse_args(argv)
    out = Path(args.out or f"outputs/word-problems/seed-{args.seed}")
    try:
        build(out, args.seed, {name: getattr(args, name) for name in SIZES}, args.labeled, console.say)
    except (DataError, ValueError) as err:
        print(f"trapo word-problems: {err}", file=sys.stderr)
        return 2
    return 0
