"""Evaluation harness: the paper's Table 1 from one command.

    python -m trapo eval --model outputs/toy/checkpoints/step-80/hf --benchmarks math,arc_c,gpqa
    make eval MODEL=... BENCH=math,arc_c,gpqa

A benchmark file is any verl-layout parquet (`prompt`, `reward_model.ground_truth`,
`data_source`) or JSONL (`question`, `answer`). A parquet holding several
`data_source`s (the shipped `math.parquet`: AIME 2024/2025, AMC, MATH-500,
Minerva, OlympiadBench) is split into one benchmark per source. Identical
prompts count as one question (the shipped AIME and AMC rows repeat each
question 8 times) and are sampled k times instead.

Metrics per benchmark: avg@k (mean accuracy over the k samples, averaged over
questions; with k = 1 this is pass@1) and optionally pass@K by the unbiased
estimator 1 - C(n - c, K) / C(n, K) (Chen et al. 2021). Every response, its
extracted answer and its grade go to `samples.jsonl`, one line per finished
question, which also makes an interrupted run resumable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from trapo import runtime
from trapo.algorithm.rewards import answer_rewards, extract_answer
from trapo.data import DataError, Question, benchmarks_dir, jsonl_rows, parquet_rows, stop_token_ids, tokenize_prompts
from trapo.engine.rollout import request_seed

# Table 1 of the paper: column label and whether the benchmark is in-domain (math).
TABLE_COLUMNS = {
    "aime": ("AIME24", True),
    "aime24": ("AIME24", True),
    "aime25": ("AIME25", True),
    "amc": ("AMC", True),
    "math": ("MATH-500", True),
    "minerva": ("Minerva", True),
    "olympiad_bench": ("Olympiad", True),
    "arc_c": ("ARC-c", False),
    "gpqa": ("GPQA*", False),
    "mmlu_pro": ("MMLU-Pro", False),
}
# The paper's protocol: avg@32 on the small competition sets, one sample elsewhere.
PAPER_SAMPLES = {"aime": 32, "aime24": 32, "aime25": 32, "amc": 32}


@dataclass
class Benchmark:
    name: str
    questions: list[Question]  # one per distinct prompt
    source: str  # file


# ----------------------------------------------------------------------------- metrics (pure)


def avg_at_k(grades: list[list[bool]]) -> float:
    """Mean over questions of the fraction of its k samples that are correct. grades: [Q][k]."""
    if not grades:
        return 0.0
    return sum(sum(g) / len(g) for g in grades) / len(grades)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per question, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(grades: list[list[bool]], k: int) -> float:
    return sum(pass_at_k(len(g), sum(g), k) for g in grades) / len(grades) if grades else 0.0


# ----------------------------------------------------------------------------- reading benchmarks


def _prompt_key(q: Question) -> str:
    text = json.dumps(q.messages) if q.messages is not None else q.question
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _group(name: str, rows: list[Question], source: str) -> Benchmark:
    """One question per distinct prompt; a repeated prompt must repeat its answer too."""
    seen: dict[str, Question] = {}
    for q in rows:
        key = _prompt_key(q)
        if key in seen:
            if seen[key].answer != q.answer:
                raise DataError(f"{q.where}: repeats the prompt of {seen[key].where} with a different answer")
            continue
        if q.answer is None:
            raise DataError(f"{q.where}: a benchmark question needs an answer")
        seen[key] = Question(f"{name}/{key}", q.question, q.answer, True, q.messages, q.where)
    return Benchmark(name, list(seen.values()), source)


def read_benchmark_file(path: Path) -> list[Benchmark]:
    """A parquet splits by `data_source`; a JSONL file is one benchmark named after the file."""
    if not path.is_file():
        raise DataError(f"{path}: benchmark file not found")
    if path.suffix == ".parquet":
        rows = parquet_rows(path)
        if "data_source" in pq.read_schema(path).names:
            sources = pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
        else:
            sources = [path.stem] * len(rows)
        names: dict[str, list[Question]] = {}
        for src, q in zip(sources, rows):
            names.setdefault(src or path.stem, []).append(q)
        return [_group(n, qs, str(path)) for n, qs in names.items()]
    if path.suffix in (".jsonl", ".json"):
        return [_group(path.stem, jsonl_rows(path), str(path))]
    raise DataError(f"{path}: unknown format (expected .parquet or .jsonl)")


def resolve_benchmarks(spec: str, data_dir: Path) -> list[Benchmark]:
    """'math,arc_c' -> files in data_dir (math.parquet, ...); an item with a '/' or a suffix is a path.

    A name that is a data_source inside a file (aime, amc, ...) selects that part of `math.parquet`.
    """
    out: list[Benchmark] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        path = Path(item)
        if "/" in item or path.suffix:
            out += read_benchmark_file(path)
            continue
        for suffix in (".parquet", ".jsonl"):
            if (data_dir / f"{item}{suffix}").is_file():
                out += read_benchmark_file(data_dir / f"{item}{suffix}")
                break
        else:
            found = [b for f in sorted(data_dir.glob("*.parquet")) for b in read_benchmark_file(f) if b.name == item]
            if not found:
                known = sorted(p.stem for p in data_dir.glob("*.parquet")) + sorted(
                    p.stem for p in data_dir.glob("*.jsonl")
                )
                raise DataError(
                    f"benchmark '{item}': no {item}.parquet/.jsonl in {data_dir} (found: {', '.join(known)})"
                )
            out.append(found[0])
    names = [b.name for b in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise DataError(f"benchmarks named twice: {', '.join(sorted(dupes))}")
    return out


# ----------------------------------------------------------------------------- running


def grade_responses(texts: list[str], gold: str, timeout: float = 5.0, verifier=None) -> list[dict]:
    """Per response: extracted answer and grade (`math_rewards`: Math-Verify; a letter gold compares letters)."""
    answers = [extract_answer(t) for t in texts]  # once: graded and kept
    rewards = answer_rewards(answers, [gold] * len(texts), timeout, verifier)
    return [{"answer": a, "correct": r == 1.0} for a, r in zip(answers, rewards)]


def evaluate(
    engine,
    tokenizer,
    benchmarks: list[Benchmark],
    *,
    n_for,
    temperature: float,
    max_tokens: int,
    template: str,
    max_prompt_tokens: int,
    seed: int = 0,
    done: dict | None = None,
    on_question=None,
    chunk: int = 64,
    verifier=None,
) -> tuple[dict, dict]:
    """Generate, grade and score; returns (results per benchmark, grades per benchmark).

    grades[name]: [questions][n] correct flags, for metrics a caller adds (pass@k,
    or scores pooled over ranks).
    n_for(name) -> samples per question. `done` maps (benchmark, uid) to a
    finished question's record (from samples.jsonl) that is reused as is;
    `on_question(record)` is called once per newly finished question, in
    chunks of `chunk` questions, so a caller can persist progress.
    """
    done = done or {}
    todo = {b.name: [q for q in b.questions if (b.name, q.uid) not in done] for b in benchmarks}
    # Every prompt is checked (length) before any generation starts.
    prompts = {name: tokenize_prompts(qs, template, tokenizer, max_prompt_tokens) for name, qs in todo.items()}
    results, grades_by_name = {}, {}
    for bench in benchmarks:
        n = n_for(bench.name)
        started = time.perf_counter()
        records = [done[(bench.name, q.uid)] for q in bench.questions if (bench.name, q.uid) in done]
        todo_b, prompts_b = todo[bench.name], prompts[bench.name]
        for start in range(0, len(todo_b), chunk):
            part = todo_b[start : start + chunk]
            outs = engine.generate(
                prompts_b[start : start + chunk],
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                seeds=[request_seed(seed, bench.name, q.uid) for q in part] if temperature > 0 else None,
            )
            for q, group in zip(part, outs):
                grades = grade_responses([r.text for r in group], q.answer, verifier=verifier)
                rec = {
                    "benchmark": bench.name,
                    "id": q.uid,
                    "question": q.question,
                    "gold": q.answer,
                    "responses": [
                        {"text": r.text, "tokens": len(r.token_ids), "truncated": r.truncated, **g}
                        for r, g in zip(group, grades)
                    ],
                }
                records.append(rec)
                if on_question:
                    on_question(rec)
        grades = [[r["correct"] for r in rec["responses"]] for rec in records]
        tokens = [r["tokens"] for rec in records for r in rec["responses"]]
        metrics = {f"avg@{n}": avg_at_k(grades)}
        if n == 1:
            metrics["pass@1"] = metrics["avg@1"]
        grades_by_name[bench.name] = grades
        results[bench.name] = {
            "questions": len(records),
            "samples": n,
            "metrics": metrics,
            "score": metrics[f"avg@{n}"],
            "tokens_generated": sum(tokens),
            "mean_response_length": sum(tokens) / len(tokens) if tokens else 0.0,
            "seconds": round(time.perf_counter() - started, 3),
            "source": bench.source,
        }
    return results, grades_by_name


def pooled_scores(engine, tokenizer, benchmarks: list[Benchmark], *, shard: int, shards: int, gather, **kwargs):
    """avg@n per benchmark and their mean over `shards` evaluators, or None without benchmarks.

    This one evaluates every `shards`-th question from `shard` (`evaluate` with
    `kwargs`); `gather(grades)` returns every shard's grades (a collective across
    processes, or `lambda g: [g]` alone).
    """
    if not benchmarks:
        return None
    mine = [Benchmark(b.name, b.questions[shard::shards], b.source) for b in benchmarks]
    _, grades = evaluate(engine, tokenizer, mine, **kwargs)
    everyone = gather(grades)
    scores = {name: avg_at_k([g for part in everyone for g in part[name]]) for name in grades}
    return {**scores, "mean": sum(scores.values()) / len(scores)}


def markdown_table(results: dict, row_label: str) -> str:
    """Laid out like the paper's Table 1: ID columns, ID avg, OOD columns, OOD avg, then any others."""
    order = list(dict.fromkeys(TABLE_COLUMNS))
    known = [b for b in order if b in results]
    other = [b for b in results if b not in TABLE_COLUMNS]
    ind = [b for b in known if TABLE_COLUMNS[b][1]]
    ood = [b for b in known if not TABLE_COLUMNS[b][1]]
    cols, vals = ["Model"], [row_label]

    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    for group, label in ((ind, "ID Avg."), (ood, "OOD Avg.")):
        for b in group:
            cols.append(TABLE_COLUMNS[b][0])
            vals.append(pct(results[b]["score"]))
        if group:
            cols.append(label)
            vals.append(pct(sum(results[b]["score"] for b in group) / len(group)))
    for b in other:
        cols.append(b)
        vals.append(pct(results[b]["score"]))
    line = "| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|\n| " + " | ".join(vals) + " |\n"
    metric = {b: next(iter(results[b]["metrics"])) for b in results}
    note = ", ".join(f"{TABLE_COLUMNS.get(b, (b,))[0]} {m}" for b, m in metric.items())
    return line + f"\nMetrics: {note}.\n"


# ----------------------------------------------------------------------------- CLI


def _load_done(path: Path, settings: dict) -> dict:
    """Finished questions from an earlier run with the same settings; a torn last line is dropped."""
    run_file = path.parent / "run.json"
    if run_file.is_file():
        before = json.loads(run_file.read_text())
        if before != settings:
            diff = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            raise DataError(
                f"{path.parent}: holds an evaluation with other settings {diff}; use another --out or --overwrite"
            )
    done, good = {}, []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # an interrupted write
            done[(rec["benchmark"], rec["id"])] = rec
            good.append(line)
        path.write_text("".join(x + "\n" for x in good))
    return done


def latest_toy_checkpoint(root: Path = Path("outputs/toy/checkpoints")) -> Path:
    from trapo.engine import checkpoint as ckpt

    found = ckpt.list_complete(root)
    if not found:
        raise DataError(f"no checkpoint under {root}: run `make train` first, or pass --model")
    return found[-1][1] / "hf"


def main(argv: list[str] | None = None) -> int:
    runtime.configure()  # before vLLM or torch is imported
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model dir (default: the latest `make train` checkpoint)")
    parser.add_argument("--benchmarks", help="comma list of names in --data-dir or file paths")
    parser.add_argument(
        "--data-dir", default=str(benchmarks_dir()), help="default: data/benchmarks, or $TRAPO_BENCHMARKS"
    )
    parser.add_argument("--n", type=int, help="samples per question (default: the paper's, 32 for AIME/AMC, else 1)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--template", default="dataset", choices=["think", "cot", "chat", "dataset", "plain"])
    parser.add_argument("--limit", type=int, help="first N questions per benchmark")
    parser.add_argument("--pass-k", type=int, help="also report pass@K (unbiased; needs n >= K)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="output dir (default: <model>/../eval or outputs/eval)")
    parser.add_argument("--overwrite", action="store_true", help="discard earlier samples in --out")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args(argv)

    try:
        model = Path(args.model) if args.model else latest_toy_checkpoint()
        if not (model / "config.json").is_file():
            raise DataError(f"--model {model}: not a Hugging Face model directory (no config.json)")
        if not args.benchmarks:
            raise DataError("--benchmarks is required (e.g. math,arc_c,gpqa)")
        benchmarks = resolve_benchmarks(args.benchmarks, Path(args.data_dir))
        if args.limit:
            benchmarks = [Benchmark(b.name, b.questions[: args.limit], b.source) for b in benchmarks]
        n_for = (lambda name: args.n) if args.n else (lambda name: PAPER_SAMPLES.get(name, 1))
        if args.pass_k and any(n_for(b.name) < args.pass_k for b in benchmarks):
            raise DataError(f"--pass-k {args.pass_k} needs --n >= {args.pass_k}")
        out = Path(args.out) if args.out else model.parent / "eval"
        out.mkdir(parents=True, exist_ok=True)
        samples = out / "samples.jsonl"
        settings = {
            "model": str(model.resolve()),
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "template": args.template,
            "seed": args.seed,
            "n": {b.name: n_for(b.name) for b in benchmarks},
        }
        if args.overwrite:
            samples.unlink(missing_ok=True)
            (out / "run.json").unlink(missing_ok=True)
        done = _load_done(samples, settings)
        (out / "run.json").write_text(json.dumps(settings, indent=2))
    except DataError as err:
        print(f"trapo.commands.eval: {err}", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer, GenerationConfig

    from trapo.engine.rollout import RolloutEngine
    from trapo.runtime import dtype_name

    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        generation_eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = None
    engine = RolloutEngine(
        str(model),
        dtype=dtype_name(args.dtype),
        max_model_len=args.max_prompt_tokens + args.max_tokens,
        seed=args.seed,
        stop_token_ids=stop_token_ids(tokenizer, generation_eos),
    )
    reused = sum(1 for key in done if key[0] in {b.name for b in benchmarks})
    generated = [0]
    with open(samples, "a") as f:

        def persist(rec: dict) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            generated[0] += 1

        try:
            results, grades = evaluate(
                engine,
                tokenizer,
                benchmarks,
                n_for=n_for,
                temperature=args.temperature,
                max_tokens=args.max_tokens,
                template=args.template,
                max_prompt_tokens=args.max_prompt_tokens,
                seed=args.seed,
                done=done,
                on_question=persist,
            )
        except DataError as err:
            print(f"trapo.commands.eval: {err}", file=sys.stderr)
            return 2
    if args.pass_k:
        for name, r in results.items():
            r["metrics"][f"pass@{args.pass_k}"] = mean_pass_at_k(grades[name], args.pass_k)
    (out / "results.json").write_text(
        json.dumps({"model": str(model), "settings": settings, "results": results}, indent=2)
    )
    table = markdown_table(results, model.parent.name if model.name == "hf" else model.name)
    (out / "results.md").write_text(table)
    print(table)
    print(
        f"generated {generated[0]} questions, reused {reused} finished ones from {samples}; outputs in {out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
