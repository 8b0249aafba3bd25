"""Evaluation harness: the paper's Table 1 from one command.

    python -m trapo eval --model outputs/toy/checkpoints/step-80/hf --benchmarks math,arc_c,gpqa
    python -m trapo eval --model Qwen/Qwen2.5-Math-7B [--revision R] --benchmarks math   # a hub id (trapo/hub.py)
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
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trapo import hub, runtime
from trapo.algorithm.pass_at_k import mean_pass_at_k
from trapo.config import BACKENDS, DTYPES, HF_DECODINGS, PROMPT_TEMPLATES, ConfigError
from trapo.data import Benchmark, DataError, benchmarks_dir, resolve_benchmarks, stop_token_ids
from trapo.training.evaluation import evaluate, pending_prompts, ungradable_golds

if TYPE_CHECKING:
    from trapo.engine.rollout_engine import EngineSettings

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


EXTEND = "or extend the context with --max-position-embeddings and --rope-theta (the paper's configs: 16384 and 40000)"


def served_context(args, model: Path) -> tuple[int, str] | None:
    """(the longest prompt + response the model serves, where that number comes from), with
    --max-position-embeddings over its config.json; None when its config.json names no context."""
    from trapo.engine.rollout import context_limit

    limit = context_limit(model, args.max_position_embeddings)
    if limit is None:
        return None
    length, key = limit
    if args.max_position_embeddings is not None and key.startswith("max_position_embeddings"):
        return length, "--max-position-embeddings" + key.removeprefix("max_position_embeddings")
    return length, f"{key} in its config.json"


SEEDS = 2**32  # numpy's (and so vLLM's) seed range: [0, 2**32)


def check_flags(args) -> None:
    """Every numeric flag's range, checked before the model is fetched or anything loads: the ranges vLLM's
    SamplingParams, numpy's seed and the pass@k estimator would reject later. A DataError naming the flag."""
    if args.n is not None and args.n < 1:
        raise DataError(f"--n {args.n}: samples per question must be >= 1")
    if not 0 <= args.temperature <= 2:
        raise DataError(f"--temperature {args.temperature}: must be in [0, 2] (0: greedy)")
    if args.temperature == 0 and args.n is not None and args.n > 1:
        raise DataError(f"--temperature 0 (greedy) gives one sample per question; --n {args.n} asks for more")
    for flag, value in (
        ("--max-tokens", args.max_tokens),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-position-embeddings", args.max_position_embeddings),
        ("--limit", args.limit),
        ("--hf-max-batch", args.hf_max_batch),
        ("--grader-workers", args.grader_workers),
    ):
        if value is not None and value < 1:
            raise DataError(f"{flag} {value}: must be >= 1")
    if args.rope_theta is not None and not 0 < args.rope_theta < math.inf:
        raise DataError(f"--rope-theta {args.rope_theta}: must be a finite number > 0")
    if not 0 <= args.seed < SEEDS:
        raise DataError(f"--seed {args.seed}: must be in [0, {SEEDS - 1}]")
    if args.pass_k is not None and (args.pass_k < 1 or (args.n is not None and args.pass_k > args.n)):
        n = f"--n ({args.n})" if args.n is not None else "--n"
        raise DataError(f"--pass-k {args.pass_k}: pass@k needs 1 <= k <= {n}, the samples per question")


def check_arguments(args, model: Path) -> None:
    """The flags (check_flags), the model's weight files and the response budget against its context, checked
    before the engine starts: DataError naming the flag or the file."""
    check_flags(args)
    problem = hub.weight_problem(model)
    if problem:
        raise DataError(f"--model {model}: {problem}")
    served = served_context(args, model)  # the prompts are measured later (tokenized): a response alone now
    if served is not None and args.max_tokens >= served[0]:
        raise DataError(
            f"--max-tokens {args.max_tokens}: leaves no room for a prompt in the {served[0]} tokens the model "
            f"serves ({served[1]}); lower it, {EXTEND}"
        )


def engine_length(args, model: Path, benchmarks: list[Benchmark], done: dict, prompts: dict) -> int:
    """The engine's max_model_len: the longest prompt left to generate for (`prompts`, pending_prompts') +
    --max-tokens; a DataError naming that prompt when the model serves fewer tokens."""
    longest, where = 0, ""
    for b in benchmarks:
        todo = [q for q in b.questions if (b.name, q.uid) not in done]
        for q, ids in zip(todo, prompts[b.name]):
            if len(ids) > longest:
                longest, where = len(ids), q.where
    served = served_context(args, model)
    if served is not None and longest + args.max_tokens > served[0]:
        room = served[0] - longest
        fix = f"lower --max-tokens to {room}" if room > 0 else "leave that benchmark out"
        raise DataError(
            f"--max-tokens {args.max_tokens} + the longest prompt's {longest} tokens ({where}) exceeds the "
            f"{served[0]} tokens the model serves ({served[1]}); {fix}, {EXTEND}"
        )
    return longest + args.max_tokens


def model_overrides_for(args, model: Path) -> dict:
    """--rope-theta and --max-position-embeddings as the config attributes both backends take: training's rule
    for model.rope_theta and model.max_position_embeddings (trapo.engine.policy.model_overrides)."""
    if args.rope_theta is None and args.max_position_embeddings is None:
        return {}
    from transformers import AutoConfig

    from trapo.config import ModelConfig
    from trapo.engine.policy import model_overrides

    settings = ModelConfig(rope_theta=args.rope_theta, max_position_embeddings=args.max_position_embeddings)
    return model_overrides(settings, AutoConfig.from_pretrained(model))


def engine_settings(args, model: Path, max_model_len: int) -> EngineSettings:
    """The engine the flags ask for on `model`, with the --rope-theta / --max-position-embeddings overrides."""
    from trapo.engine.rollout_engine import EngineSettings

    return EngineSettings(
        backend=args.backend,
        dtype=args.dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        overrides=model_overrides_for(args, model),
        hf_max_batch=args.hf_max_batch,
        hf_decoding=args.hf_decoding,
    )


def latest_toy_checkpoint(root: Path = Path("outputs/toy/checkpoints")) -> Path:
    from trapo.engine import checkpoint as ckpt

    found = ckpt.list_complete(root)
    if not found:
        raise DataError(f"no checkpoint under {root}: run `make train` first, or pass --model")
    return found[-1][1] / "hf"


def main(argv: list[str] | None = None) -> int:
    runtime.configure()  # before vLLM or torch is imported
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", help="Hugging Face model dir or hub id (default: the latest `make train` checkpoint)"
    )
    parser.add_argument("--revision", help="with a hub id: a branch, tag or commit (default: its default branch)")
    parser.add_argument("--benchmarks", help="comma list of names in --data-dir or file paths")
    parser.add_argument(
        "--data-dir", default=str(benchmarks_dir()), help="default: data/benchmarks, or $TRAPO_BENCHMARKS"
    )
    parser.add_argument("--n", type=int, help="samples per question (default: the paper's, 32 for AIME/AMC, else 1)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=8192, help="response tokens per sample (default: 8192)")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="refuse a prompt longer than this (default: no cap; the engine is sized by the longest prompt)",
    )
    parser.add_argument(
        "--rope-theta", type=float, help="RoPE theta over the model's config (as model.rope_theta; e.g. 40000)"
    )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        help="context over the model's config (as model.max_position_embeddings; e.g. 16384)",
    )
    parser.add_argument("--template", default="dataset", choices=PROMPT_TEMPLATES)
    parser.add_argument("--limit", type=int, help="first N questions per benchmark")
    parser.add_argument("--pass-k", type=int, help="also report pass@K (unbiased; 1 <= K <= --n)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="output dir (default: <model>/../eval; a hub id: outputs/eval/<org>--<name>)")
    parser.add_argument("--overwrite", action="store_true", help="discard earlier samples in --out")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="who generates: vLLM, or transformers (no vLLM); auto: vLLM when it is installed, else transformers",
    )
    parser.add_argument("--hf-max-batch", type=int, default=256, help="hf backend: sequences generated at once")
    parser.add_argument(
        "--hf-decoding",
        choices=HF_DECODINGS,
        default="auto",
        help="hf backend: how a decode step runs (rollout.hf_decoding; auto: CUDA graphs on a GPU, eager on CPU)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (also off when not a terminal)")
    parser.add_argument(
        "--verifier",
        default="math",
        help="what an answer is and when it is right: math (default), mcq, exact or module:name (docs/tasks.md)",
    )
    parser.add_argument(
        "--grader-workers", type=int, default=min(2, os.cpu_count() or 1), help="grading worker processes"
    )
    args = parser.parse_args(argv)
    try:
        from trapo.algorithm.rewards.verifiers import require_verifier
        from trapo.engine.rollout import choose_backend, require_backend

        args.backend, args.backend_chosen = choose_backend(args.backend)  # auto: said once the checks pass (_run)
        require_backend(args.backend, key="--backend", fix="--backend hf", load=False)  # one that fails to import: _run
        require_verifier(args.verifier, where="--verifier")  # before the model is fetched
    except ConfigError as err:
        print(f"trapo eval: {err}", file=sys.stderr)
        return 2

    try:
        check_flags(args)  # before the model is fetched
        source = hub.fetch(args.model, args.revision, what="--model") if args.model else None
        model = source.local_dir if source else latest_toy_checkpoint()
        if not (model / "config.json").is_file():
            raise DataError(f"--model {model}: not a Hugging Face model directory (no config.json)")
        check_arguments(args, model)
        on_hub = source is not None and source.commit is not None
        if not args.benchmarks:
            raise DataError("--benchmarks is required (e.g. math,arc_c,gpqa)")
        benchmarks = resolve_benchmarks(args.benchmarks, Path(args.data_dir))
        if args.limit:
            benchmarks = [Benchmark(b.name, b.questions[: args.limit], b.source) for b in benchmarks]
        n_for = (lambda name: args.n) if args.n else (lambda name: PAPER_SAMPLES.get(name, 1))
        several = [b.name for b in benchmarks if n_for(b.name) > 1]
        if args.temperature == 0 and several:
            raise DataError(
                f"--temperature 0 (greedy) gives one sample per question; {several[0]} takes "
                f"{n_for(several[0])} by the paper's protocol: add --n 1"
            )
        fewer = [b.name for b in benchmarks if n_for(b.name) < (args.pass_k or 0)]
        if fewer:
            raise DataError(
                f"--pass-k {args.pass_k}: pass@k needs 1 <= k <= the samples per question; {fewer[0]} takes "
                f"{n_for(fewer[0])} by the paper's protocol: add --n {args.pass_k}"
            )
        default_out = Path("outputs/eval") / args.model.replace("/", "--") if on_hub else model.parent / "eval"
        out = Path(args.out) if args.out else default_out
        out.mkdir(parents=True, exist_ok=True)
        samples = out / "samples.jsonl"
        settings = {
            "model": source.label if on_hub else str(model.resolve()),  # a hub id with its commit
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "template": args.template,
            "seed": args.seed,
            "n": {b.name: n_for(b.name) for b in benchmarks},
        }
        if args.backend != "vllm":  # another sampler: its samples are not mixed with vLLM's
            settings["backend"] = args.backend
        if args.verifier != "math":  # other grades: not mixed with Math-Verify's
            settings["verifier"] = args.verifier
        for key in ("rope_theta", "max_position_embeddings"):  # another model: set only when given
            if getattr(args, key) is not None:
                settings[key] = getattr(args, key)
        if args.overwrite:
            samples.unlink(missing_ok=True)
            (out / "run.json").unlink(missing_ok=True)
        done = _load_done(samples, settings)
        (out / "run.json").write_text(json.dumps(settings, indent=2))
    except (DataError, ConfigError) as err:
        print(f"trapo eval: {err}", file=sys.stderr)
        return 2

    for line in ungradable_golds(benchmarks) if args.verifier == "math" else []:  # scored 0: said before generating
        print(f"trapo eval: warning: {line}", file=sys.stderr)

    from trapo import console

    # From here the libraries' output (vLLM and torch logs, warnings) goes to <out>/log.txt; ours to the terminal.
    log = console.capture(out, 0, console.debug_requested("info"))
    try:
        return _run(args, model, out, samples, settings, benchmarks, n_for, done)
    except Exception as err:  # noqa: BLE001 - one line here, the traceback in the log
        import traceback

        traceback.print_exc()  # into log.txt (the terminal when nothing was captured)
        where = f"; traceback in {log}" if log else ""
        print(
            f"trapo eval: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}{where}",
            file=console.terminal(),
        )
        return 1


class BenchmarkBars:
    """One progress bar per benchmark, opened at its first finished question: questions done of those left,
    samples per second, time left."""

    def __init__(self, benchmarks: list[Benchmark], done: dict, n_for, enabled: bool):
        self.left = {b.name: sum((b.name, q.uid) not in done for q in b.questions) for b in benchmarks}
        self.n_for, self.enabled = n_for, enabled
        self.name, self.bar = None, None

    def advance(self, name: str) -> None:
        from trapo import console

        if name != self.name:
            self.close()
            self.name, self.bar = name, console.progress_bar(self.left[name], name, self.enabled, unit="q")
        self.bar.update(1)
        elapsed = self.bar.format_dict["elapsed"]
        if elapsed > 0:
            self.bar.set_postfix_str(f"{self.bar.n * self.n_for(name) / elapsed:.1f} samples/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(args, model: Path, out: Path, samples: Path, settings: dict, benchmarks, n_for, done: dict) -> int:
    """Load the model into the chosen engine, generate what is not done yet, grade, score, write the outputs."""
    from transformers import AutoTokenizer, GenerationConfig

    from trapo import console
    from trapo.engine.rollout import require_backend
    from trapo.engine.rollout_engine import open_engine

    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        generation_eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = None
    stops = stop_token_ids(tokenizer, generation_eos)
    try:  # every prompt measured and checked before the engine loads
        cap = args.max_prompt_tokens
        prompts = pending_prompts(
            tokenizer, benchmarks, template=args.template, max_prompt_tokens=cap, done=done, key="--max-prompt-tokens"
        )
        max_model_len = engine_length(args, model, benchmarks, done, prompts)
    except DataError as err:
        print(f"trapo eval: {err}", file=console.terminal())
        return 2
    try:  # a vLLM that fails to import: one line naming --backend hf, after the checks and before the model loads
        require_backend(args.backend, key="--backend", fix="--backend hf")
    except ConfigError as err:
        import traceback

        traceback.print_exc()  # into log.txt
        print(f"trapo eval: {err}", file=console.terminal())
        return 2
    if args.backend_chosen:  # --backend auto: which engine, and why, once
        console.say(f"--backend auto: {args.backend} ({args.backend_chosen})")
    engine = open_engine(
        engine_settings(args, model, max_model_len), str(model), tokenizer=tokenizer, stop_token_ids=stops
    )
    from trapo.engine.grading.verifier import MathVerifier

    verifier = MathVerifier(num_workers=args.grader_workers, spec=args.verifier)
    reused = sum(1 for key in done if key[0] in {b.name for b in benchmarks})
    generated = [0]
    bars = BenchmarkBars(benchmarks, done, n_for, enabled=not args.no_progress)
    with open(samples, "a") as f, bars:

        def persist(rec: dict) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            generated[0] += 1
            bars.advance(rec["benchmark"])

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
            prompts=prompts,
            verifier=verifier,
        )
    if args.pass_k:
        for name, r in results.items():
            r["metrics"][f"pass@{args.pass_k}"] = mean_pass_at_k(grades[name], args.pass_k)
    (out / "results.json").write_text(
        json.dumps({"model": settings["model"], "settings": settings, "results": results}, indent=2)
    )
    label = None if settings["model"].startswith("/") else settings["model"].partition("@")[0]  # a hub id
    table = markdown_table(results, label or (model.parent.name if model.name == "hf" else model.name))
    (out / "results.md").write_text(table)
    print(table, file=console.terminal_out(), flush=True)
    print(
        f"generated {generated[0]} questions, reused {reused} finished ones from {samples}; outputs in {out}",
        file=console.terminal(),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
