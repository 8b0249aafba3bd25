"""Rewrite the README's generated blocks from the outputs that produce them.

    python -m trapo readme --train outputs/toy      # after `make train`
    make readme-figures                             # both steps
    python -m trapo readme --reproduce docs/reproduce-toy   # after `make reproduce-toy` (it runs this)
    python -m trapo readme --plan                   # the memory plans of the paper's 7B config

A block sits between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`
lines; everything between them is replaced, so the README never quotes a
figure no code printed. Blocks: `make-train` (the summary `make train` prints,
from its run's summary.json) and `reproduce-toy` (the reproduction's results.md,
its image links made relative to the README) and `memory-plan` (what
`python -m trapo doctor --plan` prints for configs/trapo_1k_3k.yaml on 8 x 80 and
8 x 141 GiB).
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

README = runtime.ROOT / "README.md"


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the block `name` holding `body`; ValueError if the markers are missing."""
    pattern = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n)(.*?)(<!-- /generated:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"README has no block '{name}' (<!-- generated:{name} --> ... <!-- /generated:{name} -->)")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text, count=1)


def train_block(run_dir: Path) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    return f"```\n{summary_text(summary)}\n```"


def reproduce_block(docs: Path, readme: Path = README) -> str:
    """results.md of a reproduction, with its run time and its relative links pointing from the README."""
    body = (docs / "results.md").read_text()
    minutes = json.loads((docs / "results.json").read_text()).get("minutes")
    prefix = Path(os.path.relpath(docs.resolve(), readme.resolve().parent)).as_posix()
    body = re.sub(r"\]\((?![a-z]+:|/)([^)]+)\)", lambda m: f"]({prefix}/{m.group(1)})", body)
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
    """Peak GiB per phase and the verdict of every paper config on 8 GPUs of each size (the doctor's plan)."""
    import json as _json

    from trapo.config import load_config
    from trapo.engine.memory_plan import GiB, memory_plan, model_arch

    rows = [
        "| config | GPUs | start-up | rollouts | update | KV sequences held / needed | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(Path(README.parent / "configs").glob("*.yaml")):
        cfg = load_config(str(path))
        if cfg.toy.enabled:
            continue
        ds = _json.loads((README.parent / cfg.train.deepspeed_config).read_text())
        arch = model_arch(cfg.model.path)
        for gb in cards:
            plan = memory_plan(cfg, 8, gb * GiB, arch, ds)
            peaks = " | ".join(f"{plan.peak(p) / GiB:.1f}" for p in ("start-up", "rollout", "update"))
            held = f"{plan.kv['sequences_held']} / {plan.kv['sequences_needed']}"
            verdict = "fits" if plan.fits else "does not fit"
            rows.append(
                f"| {path.name} | 8 x {gb} GiB | {peaks} | {held} | {verdict}{' (warning)' if plan.warnings else ''} |"
            )
    return "Per-GPU peak GiB by phase for every paper config:\n\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=Path, help="the run directory of `make train` (outputs/toy)")
    parser.add_argument("--reproduce", type=Path, help="the results directory of `make reproduce-toy`")
    parser.add_argument("--plan", action="store_true", help="the memory-plan block (trapo.commands.doctor --plan)")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    try:
        if args.train:
            text = replace_block(text, "make-train", train_block(args.train))
        if args.reproduce:
            text = replace_block(text, "reproduce-toy", reproduce_block(args.reproduce, args.readme))
        if args.plan:
            text = replace_block(text, "memory-plan", plan_block())
    except (OSError, ValueError) as err:
        print(f"trapo.commands.readme: {err}", file=sys.stderr)
        return 2
    args.readme.write_text(text)
    print(f"updated {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
