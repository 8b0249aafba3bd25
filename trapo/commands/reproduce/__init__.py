"""`make reproduce-toy`: the paper's claims at toy scale, under the paper's protocol and under equal steps.

The plan below was fixed, and written here and in the README, before any method ran.
The only setting chosen by looking at a model is the base model's warm start (3000
steps, clipped and decayed to convergence: toy.sft_schedule decay; the constant-rate
fit it replaced ended wherever a CPU's rounding left it), and only the base model was
looked at (its avg@4 heads results.md).

Task and base model
- `trap` (trapo/commands/toy.py): two-digit subtractions, half needing a borrow; the warm
  start's teacher made the no-borrow error on 60% of its borrow examples, so a
  majority vote is confidently wrong there. OOD family: two-digit additions.
- ONE base model, built once from toy seed 0 (tokenizer, weights, question pool).
  Seeds vary only the labeled/unlabeled split (`data.labeled_ratio` draws 64 of the
  256 training questions with the run seed) and the RL randomness (the run seed), so
  methods are compared within a seed: the differences are paired.
Splits (disjoint, fixed by the base model)
- train: 256 subtractions (64 labeled + 192 unlabeled, golds hidden from training);
- validation: 128 subtractions, the only split that picks a checkpoint;
- test: 128 subtractions (ID) and 128 additions (OOD), never used for any choice;
- OOD setting (paper Table 2): the same 64 labeled + 192 unlabeled additions.
Methods: supervised (64 labeled only), unsupervised TTRL (all 256, labels hidden),
naive semi-supervised (64 labeled + TTRL on 192), TraPO, TraPO with random selection
of as many unlabeled questions (the paper's control); OOD setting: TraPO and naive
semi-supervised with unlabeled additions (supervised is the same run as above).
Budget: 64 questions x 8 rollouts per step, one update per step, lr 2e-4, Dr.GRPO,
entropy 0.01, TraPO warm-up 3 epochs, top-p 0.1, Gamma 0.4 (configs/toy_trap.yaml).
Two protocols, read from the same runs:
- `equal_epochs` (the paper's, appendix "Training Cost Analysis"): EPOCHS passes over
  each method's own training set. 256-question methods take 4 steps per epoch, the
  64-question supervised run 1, so it stops at EPOCHS steps;
- `equal_steps`: every method gets the 256-question methods' step count (the same
  rollout compute). Only supervised differs between the protocols, and its
  equal-epochs run is the first EPOCHS steps of its equal-steps run: it is run once
  to the longer budget and read at both.
Every EVAL_EVERY steps each run scores validation, ID test and OOD test (avg@4 at
T = 0.6). Per protocol two read-outs: `best_validation` (the paper's rule: test
accuracy at the evaluated step with the highest validation score within the budget,
ties to the earlier step) and `last` (test accuracy at the budget's last step).
Seeds: 0-7, 16 epochs (64 steps); QUICK: seeds 0-2, 8 epochs (32 steps).
Criteria (CLAIMS, in code below; paired over seeds, 95% interval from the paired t
distribution with n-1 degrees of freedom): a claim "X beats Y" is *held* when the
interval of the mean difference X - Y lies above 0, *not held* when below, and
*inconclusive* when it contains 0. Figure 4: per seed, the pseudo-label accuracy of
the top 10% of unlabeled questions by TCS minus the bottom 10%, pooled over the
epochs after warm-up; held when its interval lies above 0; the paper's size (> 40
points) is checked the same way against 40. The random-selection control: TraPO's
top-10% accuracy minus the accuracy of the random run's selected questions.

Each run is `trapo_train.py` on `configs/toy_trap.yaml`; two run side by side (one
thread each). A finished run (its summary.json, same step count) is reused, so an
interrupted reproduction continues. Outputs: runs under `--out`; results.md,
results.json and the plots under `--docs`.

The sensitivity and selection studies share the command: `--study FILE` runs one
study file (study.py), `--studies DIR` all of a directory's into one results file,
and `--render DOCS` writes their page and plots from that file (sensitivity.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trapo import runtime
from trapo.commands.reproduce.analysis import (
    analyse,
    decile_accuracy,
    figure4,
    figure4_epoch_means,
    paired_interval,
    read_out,
    selected_accuracy,
    t_cdf,
    t_quantile,
    verdict,
)
from trapo.commands.reproduce.forking import RunFailed, close_parent
from trapo.commands.reproduce.plan import (
    CLAIMS,
    CONFIG,
    EPOCHS,
    EVAL_EVERY,
    LABELED_RATIO,
    LABELS,
    METHODS,
    PAPER_FIG4_GAP,
    PROTOCOLS,
    QUICK_EPOCHS,
    QUICK_SEEDS,
    ROOT,
    RULES,
    SEEDS,
    TINY_TOY,
    budgets,
    steps_per_epoch,
)
from trapo.commands.reproduce.presentation import markdown, plots
from trapo.commands.reproduce.runs import base_eval, build_base, ood_train_file, read_run, run_one

__all__ = [
    "CLAIMS",
    "CONFIG",
    "EPOCHS",
    "EVAL_EVERY",
    "LABELED_RATIO",
    "LABELS",
    "METHODS",
    "PAPER_FIG4_GAP",
    "PROTOCOLS",
    "QUICK_EPOCHS",
    "QUICK_SEEDS",
    "ROOT",
    "RULES",
    "SEEDS",
    "TINY_TOY",
    "analyse",
    "base_eval",
    "budgets",
    "build_base",
    "decile_accuracy",
    "figure4",
    "figure4_epoch_means",
    "main",
    "markdown",
    "ood_train_file",
    "paired_interval",
    "plots",
    "read_out",
    "read_run",
    "run_one",
    "selected_accuracy",
    "steps_per_epoch",
    "t_cdf",
    "t_quantile",
    "verdict",
]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        close_parent()  # the command ends without the interpreter's teardown: its forking parent goes now


def _main(argv: list[str] | None) -> int:
    runtime.configure()  # before torch: the base model is built in this process (one thread on CPU)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"seeds {QUICK_SEEDS}, {QUICK_EPOCHS} epochs")
    parser.add_argument("--seeds", default=None, help="comma list (default 0-7; quick 0-2)")
    parser.add_argument("--epochs", type=int, default=None, help=f"default {EPOCHS}; quick {QUICK_EPOCHS}")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (each uses one thread on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="runs; default outputs/reproduce-toy[-quick]")
    parser.add_argument("--docs", type=Path, default=None, help="results and plots; default: --out")
    parser.add_argument("--tiny", action="store_true", help="a few questions only (the test suite's smoke run)")
    parser.add_argument("--study", help="a study file (configs/studies/): its conditions x seeds, then its claims")
    parser.add_argument("--print", action="store_true", help="with --study: list the launch commands, run nothing")
    parser.add_argument("--conditions", help="with --study: run only these (comma list); a report reads every run")
    parser.add_argument("--studies", type=Path, help="a directory of study files: run them all, results to --docs")
    parser.add_argument("--render", type=Path, help="a --docs directory: its page and plots from its results file")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.study:  # trapo/commands/reproduce/study.py
        from trapo.commands.reproduce import study

        return study.main(args)
    if args.studies or args.render:  # trapo/commands/reproduce/sensitivity.py
        from trapo.commands.reproduce import sensitivity

        return sensitivity.main(args)
    if args.print:
        parser.error("--print goes with --study")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else (QUICK_SEEDS if args.quick else SEEDS)
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else EPOCHS)
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"reproduce: unknown methods {unknown}; known: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if (epochs * min(map(steps_per_epoch, methods))) % EVAL_EVERY:
        print(f"reproduce: --epochs must make every budget a multiple of {EVAL_EVERY} steps", file=sys.stderr)
        return 2
    out = args.out or Path("outputs/reproduce-toy-quick" if args.quick else "outputs/reproduce-toy")
    docs = args.docs or out
    out.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    toy, extra = dict(cfg["toy"]), list(args.overrides)
    if args.tiny:  # the test suite's smoke run: every path, a few questions
        toy.update(TINY_TOY)
        extra = ["train.rollout_batch_size=16", "train.update_batch_size=16", "selection.warmup_epochs=1", *extra]

    def log(msg: str) -> None:
        print(f"[reproduce] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    root = build_base(toy, out / "base-assets", log)
    steps = budgets(epochs)["equal_steps"]
    jobs = [(m, s) for s in seeds for m in methods]
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {key: pool.submit(run_one, out, root, key[0], key[1], steps[key[0]], extra, log) for key in jobs}
            runs = {key: f.result() for key, f in futures.items()}
        base = base_eval(out, root, cfg, log)
    except RunFailed as err:  # the runs finished before it are kept
        print(f"reproduce: {err}", file=sys.stderr)
        return 1
    data = {key: read_run(d) for key, d in runs.items()}
    res = analyse(data, seeds, epochs, base)
    res["minutes"] = round((time.perf_counter() - started) / 60, 1)
    (docs / "results.json").write_text(json.dumps(res, indent=1))
    (docs / "results.md").write_text(markdown(res))
    plots(res, data, docs)
    print(markdown(res))
    log(f"done in {res['minutes']} min; results in {docs}, runs in {out}")
    return 0
