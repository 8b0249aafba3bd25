"""Rewrite the generated blocks of README.md and docs/ from the outputs that produce them.

    python -m trapo readme --train outputs/toy      # after `make train`
    python -m trapo readme --test outputs/make-test.xml   # after `make test` (it writes that file)
    make readme-figures                             # both steps
    python -m trapo readme --reproduce docs/reproduce-toy   # after `make reproduce-toy` (it runs this)
    python -m trapo readme --plan                   # the memory plans of the paper's 7B config
    python -m trapo readme --bench outputs/bench    # after `make bench` (it runs this)
    python -m trapo readme                          # which block lives in which file

A block sits between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`
lines; everything between them is replaced, so the documentation never quotes a
figure no code printed. Each block lives in one file (`BLOCKS`):

- `make-train` in README.md: the summary `make train` prints, from its run's summary.json, and the same run's
  on AVX2 kernels (`make readme-figures` runs both);
- `make-test` in README.md: how the last `make test` ended, from the JUnit XML it writes;
- `reproduce-toy` in docs/reproduce-toy.md: the reproduction's results.md, its relative links
  rewritten to point from that file;
- `memory-plan` in docs/memory-plan.md: what `python -m trapo doctor --plan` prints for
  configs/trapo_1k_3k.yaml on 8 x 80 and 8 x 141 GiB, and every paper config's verdict;
- `bench-rollout` in docs/benchmarks.md: what bench/bench_rollout.py printed for both backends
  (`make bench` saves it as outputs/bench/rollout-vllm.txt and rollout-hf.txt).
- `bench-lora` in docs/benchmarks.md: what bench/bench_lora.py printed (outputs/bench/lora.txt).
- `bench-peers` in docs/benchmarks.md: what bench/peers/run.py printed (`make bench-peers` saves it as
  outputs/bench/peers.txt and writes the block itself), and `peers-ratios` in README.md: its ratio lines.
- `real-prompts` in docs/real-model.md: what bench/bench_real_prompts.py printed (outputs/bench/real-prompts.txt,
  `make real-figures`);
- `real-step` in docs/real-model.md: what bench/bench_real_step.py printed (outputs/bench/real-step.txt);
- `real-passrates` in docs/real-model.md: the base model's per-question pass rates on the word problems, from
  the `trapo eval --n 8` run that `make real-figures` makes (`--real-base DIR`), and its plot;
- `train-real` in docs/real-model.md: the summary `make train-real` printed, with its steps' timings
  (`--real-run RUN_DIR`).
- `bench-peers-real` in docs/benchmarks.md: what bench/peers/run.py --job real printed (outputs/bench/peers-real.txt,
  `make bench-peers JOB=real` writes the block itself).
- `bench-vote` in docs/benchmarks.md: what bench/bench_vote.py printed (it saves outputs/bench/vote.txt
  and writes the block itself).

`--file PATH` writes the blocks asked for into PATH instead (tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from trapo import runtime
from trapo.training.metrics import summary_text

ROOT = runtime.ROOT
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Every generated block and the file it lives in.
BLOCKS = {
    "make-train": README,
    "make-test": README,
    "reproduce-toy": DOCS / "reproduce-toy.md",
    "memory-plan": DOCS / "memory-plan.md",
    "bench-rollout": DOCS / "benchmarks.md",
    "bench-lora": DOCS / "benchmarks.md",
    "bench-peers": DOCS / "benchmarks.md",
    "bench-peers-real": DOCS / "benchmarks.md",
    "bench-vote": DOCS / "benchmarks.md",
    "peers-ratios": README,
    "real-passrates": DOCS / "real-model.md",
    "real-prompts": DOCS / "real-model.md",
    "real-step": DOCS / "real-model.md",
    "train-real": DOCS / "real-model.md",
}
WORD_PROBLEMS = ROOT / "outputs" / "word-problems" / "seed-0"  # make word-problems' splits (problems.jsonl)
BENCH_ROLLOUT = ("rollout-vllm.txt", "rollout-hf.txt")  # bench_rollout.py's output, per backend
BENCH_LORA = "lora.txt"  # bench_lora.py's output
BENCH_PEERS = "peers.txt"  # bench/peers/run.py's output
BENCH_PEERS_REAL = "peers-real.txt"  # bench/peers/run.py --job real's output
BENCH_VOTE = "vote.txt"  # bench_vote.py's output
BENCH_REAL_PROMPTS = "real-prompts.txt"  # bench_real_prompts.py's output (make real-figures)
BENCH_REAL_STEP = "real-step.txt"  # bench_real_step.py's output (make real-figures)
# The blocks that show a bench's saved output whole (fenced_block), and its file in the --bench folder.
FENCED = {
    "bench-peers": BENCH_PEERS,
    "bench-peers-real": BENCH_PEERS_REAL,
    "bench-vote": BENCH_VOTE,
    "real-prompts": BENCH_REAL_PROMPTS,
    "real-step": BENCH_REAL_STEP,
}


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the block `name` holding `body`; ValueError if the markers are missing."""
    pattern = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n)(.*?)(<!-- /generated:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no block '{name}' (<!-- generated:{name} --> ... <!-- /generated:{name} -->)")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text, count=1)


def train_block(run_dirs: list[Path]) -> str:
    """The summary each run printed, after a line naming torch's CPU kernel set it ran on (its figures depend on
    it; recorded in summary.json as `cpu_kernels`): `make train`'s run first, then the same run on other kernel
    sets (`make readme-figures` adds one on AVX2), each kernel set once; with more than one, how far apart
    their held-out figures are."""
    summaries, seen = [], set()
    for run_dir in run_dirs:
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("cpu_kernels") is None or summary["cpu_kernels"] not in seen:
            seen.add(summary.get("cpu_kernels"))
            summaries.append(summary)
    parts = []
    for summary in summaries:
        kernels = summary.get("cpu_kernels")
        where = (
            f"With torch's {kernels} CPU kernels (`torch.backends.cpu.get_cpu_capability()`):\n\n" if kernels else ""
        )
        parts.append(f"{where}```\n{summary_text(summary)}\n```")
    if len(summaries) > 1:
        parts.append(kernel_spread(summaries))
    return "\n\n".join(parts)


def kernel_spread(summaries: list[dict]) -> str:
    """The largest difference between the runs' held-out figures, before and after training, per measure."""
    spreads = []
    for name, key in (("greedy", "heldout_accuracy"), ("avg@k", "heldout_avg")):
        for when in ("before", "after"):
            values = [s.get(f"{key}_{when}") for s in summaries]
            if None not in values:
                spreads.append(f"{name} {when} {max(values) - min(values):.3f}")
    return "Largest difference between these kernel sets: " + ", ".join(spreads) + "."


def test_block(report: Path) -> str:
    """The end of a `make test` run: counts and wall time from pytest's JUnit XML (`--junitxml`)."""
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    minutes, seconds = divmod(round(float(suite.get("time"))), 60)
    counts = [f"{total - failed - errors - skipped} passed", f"{skipped} skipped"]
    counts += [f"{n} {word}" for n, word in ((failed, "failed"), (errors, "errors")) if n]
    return f"```\n$ make test\n{', '.join(counts)} in {minutes}:{seconds:02d} (two pytest-xdist workers)\n```"


def reproduce_block(docs: Path, target: Path = BLOCKS["reproduce-toy"]) -> str:
    """results.md of a reproduction, with its run time and its relative links pointing from `target`, the
    file the block is written into."""
    body = (docs / "results.md").read_text()
    minutes = json.loads((docs / "results.json").read_text()).get("minutes")
    prefix = Path(os.path.relpath(docs.resolve(), target.resolve().parent)).as_posix()
    body = re.sub(r"\]\((?![a-z]+:|/|#)([^)]+)\)", lambda m: f"]({prefix}/{m.group(1)})", body)
    return f"`make reproduce-toy` took {minutes} min for this run.\n\n{body}"


def plan_block(config: str = "configs/trapo_1k_3k.yaml", cards: tuple[int, ...] = (80, 141)) -> str:
    """The doctor's memory plan of `config` on 8 GPUs of each size, with the command that printed it."""
    import contextlib
    import io

    from trapo.commands import doctor

    parts = []
    for gb in cards:
        argv = ["--plan", "--config", config, "--gpus", "8", "--gpu-memory-gb", str(gb)]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            doctor.main(argv)
        parts.append(f"`python -m trapo doctor {' '.join(argv)}`:\n\n```\n{out.getvalue().rstrip()}\n```")
    return "\n\n".join([verdicts_table(cards), *parts])


def verdicts_table(cards: tuple[int, ...]) -> str:
    """Peak GiB per phase and the verdict of every paper config on 8 GPUs of each size (a `*_1gpu` config: on
    one), from the doctor's plan."""
    import json as _json

    from trapo.config import load_config
    from trapo.engine.memory_plan import GiB, memory_plan
    from trapo.engine.model_shapes import model_arch

    rows = [
        "| config | GPUs | start-up | rollouts | update | KV sequences held / needed | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(str(path))
        if cfg.toy.enabled:
            continue
        ds = _json.loads((ROOT / cfg.train.deepspeed_config).read_text())
        arch = model_arch(cfg.model.path)
        gpus = 1 if path.stem.endswith("_1gpu") else 8  # a config written for one GPU is planned on one
        for gb in cards:
            plan = memory_plan(cfg, gpus, gb * GiB, arch, ds)
            peaks = " | ".join(f"{plan.peak(p) / GiB:.1f}" for p in ("start-up", "rollout", "update"))
            held = f"{plan.kv['sequences_held']} / {plan.kv['sequences_needed']}"
            verdict = ("fits" if plan.fits else "does not fit") + (" (warning)" if plan.warnings else "")
            rows.append(f"| {path.name} | {gpus} x {gb} GiB | {peaks} | {held} | {verdict} |")
    return "Per-GPU peak GiB by phase for every paper config:\n\n" + "\n".join(rows)


def _bench_lines(files: list[Path], starts: tuple[str, ...]) -> str:
    """A bench's own printed lines (those starting with `starts`; the libraries' log lines dropped), fenced."""
    lines = [line for file in files for line in file.read_text().splitlines() if line.startswith(starts)]
    return "```\n" + "\n".join(lines) + "\n```"


def bench_block(folder: Path) -> str:
    """bench_rollout.py's result lines: its title and the indented figures, both backends."""
    return _bench_lines([folder / name for name in BENCH_ROLLOUT], ("rollout", "  "))


def bench_lora_block(folder: Path) -> str:
    """bench_lora.py's table lines."""
    mine = ("merge/unmerge", "toy", "1.5B", "set-up", "full ", "lora-", "  merged", "  adapter")  # its prints
    return _bench_lines([folder / BENCH_LORA], mine)


def fenced_block(name: str, folder: Path) -> str:
    """A bench's saved output shown whole, fenced: the block `name` of FENCED, from its file in `folder`."""
    return "```\n" + (folder / FENCED[name]).read_text().rstrip() + "\n```"


def peers_ratios_block(folder: Path) -> str:
    """bench/peers/run.py's first line and its ratio lines (ours / TRL), fenced: what the README quotes."""
    lines = (folder / BENCH_PEERS).read_text().splitlines()
    return "```\n" + "\n".join([lines[0], *(line for line in lines if " / " in line)]) + "\n```"


def real_passrates_block(eval_dir: Path, target: Path) -> str:
    """The per-question pass-rate table of a `trapo eval --n K` run by the word problems' cells, and its plot
    (written beside `target`, in its folder's real-model/)."""
    from trapo.commands.report import passrates

    settings = json.loads((eval_dir / "run.json").read_text())
    rows = passrates.read(eval_dir / "samples.jsonl", WORD_PROBLEMS / "problems.jsonl")
    png = passrates.plot(rows, target.parent / "real-model" / "base-passrates.png")
    n = max(settings["n"].values())
    return (
        f"{Path(settings['model']).name}, {n} samples per question at temperature {settings['temperature']:g}, "
        f"at most {settings['max_tokens']} tokens (`trapo eval`, vLLM):\n\n"
        + passrates.table(rows)
        + f"\n\n![per-question pass rates]({png.relative_to(target.parent).as_posix()})"
    )


def _differs(a, b) -> bool:
    """Two config values differ (paths compared normalised: ./models/x is models/x)."""
    if isinstance(a, str) and isinstance(b, str) and "/" in a + b:
        return os.path.normpath(a) != os.path.normpath(b)
    return a != b


def selection_line(run_dir: Path) -> str:
    """The paper's Figure 4 read on one run (selection.jsonl, every epoch end that selected, pooled): how
    often the majority vote was right for the top and the bottom 10% of unlabeled questions by TCS, and for
    those the gate selected and rejected; "" without a selection."""
    from trapo.commands.reproduce.analysis import selection_precision

    path = run_dir / "selection.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if not rows:
        return ""
    picked = selection_precision(rows)

    def share(xs: list) -> str:
        return f"{sum(xs) / len(xs):.2f} of {len(xs)}" if xs else "-"

    return (
        f"majority vote right, over {len(rows)} epoch ends: top 10% by TCS {share(picked['top10'])}, bottom 10% "
        f"{share(picked['bottom10'])}; selected {share(picked['selected'])}, rejected {share(picked['rejected'])}\n"
    )


def train_real_block(run_dirs: list[Path]) -> str:
    """Per `make train-real` run, in the order they started (starts.jsonl): its settings that differ from the
    shipped config (config.yaml), the summary it printed at its end (summary.json) and its steps' mean timings
    (metrics.jsonl)."""
    import yaml

    from trapo.config import flatten

    def started(run_dir: Path) -> str:
        return json.loads((run_dir / "starts.jsonl").read_text().splitlines()[0])["time"]

    shipped = flatten(yaml.safe_load((ROOT / "configs" / "real_smollm2.yaml").read_text()))
    parts = []
    for run_dir in sorted(run_dirs, key=started):
        summary = json.loads((run_dir / "summary.json").read_text())
        ran = flatten(yaml.safe_load((run_dir / "config.yaml").read_text()))
        changed = [
            f"{k}={ran.get(k)}"  # a key newer than the run: None
            for k in sorted(shipped)
            if k not in ("run_name", "resume_from") and _differs(ran.get(k), shipped[k])
        ]
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "timing" in s and "loss" in s]
        phases = ("rollout", "grading", "update", "weight_push", "step")
        mean = {p: sum(s["timing"].get(p, 0.0) for s in steps) / len(steps) for p in phases}
        total = sum(s["timing"]["step"] for s in steps)
        timing = ", ".join(f"{p} {mean[p]:.1f} s" for p in phases)
        title = "configs/real_smollm2.yaml" + (f" with {' '.join(changed)}" if changed else " as shipped")
        parts.append(
            f"{title}:\n\n```\n{summary_text(summary)}\n{selection_line(run_dir)}"
            f"{len(steps)} steps in {total / 60:.1f} min of training; per step: {timing}\n```"
        )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--train",
        type=Path,
        nargs="+",
        help="the run directory of `make train` (outputs/toy), then the same run's on other CPU kernel sets",
    )
    parser.add_argument("--test", type=Path, help="the JUnit XML of `make test` (outputs/make-test.xml)")
    parser.add_argument("--reproduce", type=Path, help="the results directory of `make reproduce-toy`")
    parser.add_argument("--plan", action="store_true", help="the memory-plan block (trapo.commands.doctor --plan)")
    parser.add_argument("--bench", type=Path, help="the folder `make bench` saved its benches' outputs in (each found)")
    parser.add_argument(
        "--real-base", type=Path, help="the `trapo eval --n 8` run of the base model (make real-figures)"
    )
    parser.add_argument("--real-run", type=Path, nargs="+", help="run directories of `make train-real`")
    parser.add_argument(
        "--file", "--readme", dest="file", type=Path, help="write the blocks into this file instead of their own"
    )
    args = parser.parse_args(argv)
    wanted = [
        name
        for name, on in (
            ("make-train", args.train),
            ("make-test", args.test),
            ("reproduce-toy", args.reproduce),
            ("memory-plan", args.plan),
            ("bench-rollout", args.bench and all((args.bench / n).is_file() for n in BENCH_ROLLOUT)),
            ("bench-lora", args.bench and (args.bench / BENCH_LORA).is_file()),
            *((name, args.bench and (args.bench / file).is_file()) for name, file in FENCED.items()),
            ("peers-ratios", args.bench and (args.bench / BENCH_PEERS).is_file()),
            ("real-passrates", args.real_base),
            ("train-real", args.real_run),
        )
        if on
    ]
    if args.bench and not any(name in ("bench-rollout", "bench-lora", *FENCED) for name in wanted):
        files = [*BENCH_ROLLOUT, BENCH_LORA, *FENCED.values()]
        print(f"trapo readme: {args.bench}: no benchmark output ({', '.join(files)})", file=sys.stderr)
        return 2
    if not wanted:
        for name, path in BLOCKS.items():
            print(f"{name}: {path.relative_to(ROOT).as_posix()}")
        return 0
    texts: dict[Path, str] = {}  # every file is written only once all its blocks were built
    try:
        for name in wanted:
            target = args.file or BLOCKS[name]
            if name == "make-train":
                body = train_block(args.train)
            elif name == "make-test":
                body = test_block(args.test)
            elif name == "reproduce-toy":
                body = reproduce_block(args.reproduce, target)
            elif name == "bench-rollout":
                body = bench_block(args.bench)
            elif name == "bench-lora":
                body = bench_lora_block(args.bench)
            elif name in FENCED:
                body = fenced_block(name, args.bench)
            elif name == "peers-ratios":
                body = peers_ratios_block(args.bench)
            elif name == "real-passrates":
                body = real_passrates_block(args.real_base, target)
            elif name == "train-real":
                body = train_real_block(args.real_run)
            else:
                body = plan_block()
            text = texts[target] if target in texts else target.read_text()
            try:
                texts[target] = replace_block(text, name, body)
            except ValueError as err:
                raise ValueError(f"{target}: {err}") from None
    except (OSError, ValueError) as err:
        print(f"trapo readme: {err}", file=sys.stderr)
        return 2
    for target, text in texts.items():
        target.write_text(text)
        print(f"updated {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
