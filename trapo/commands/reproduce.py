"""`make reproduce-toy`: the paper's claims at toy scale, under the paper's protocol and under equal steps.

The plan below was fixed, and written here and in the README, before any method ran.
The only number chosen by looking at a model is the base model's warm start
(3000 steps), and only the base model was looked at (its avg@4 is validation 19.1%,
ID test 18.6%, OOD test 15.2%: neither ~0 nor ~1).

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
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trapo import runtime

ROOT = runtime.ROOT
CONFIG = ROOT / "configs" / "toy_trap.yaml"

SEEDS, EPOCHS = [0, 1, 2, 3, 4, 5, 6, 7], 16
QUICK_SEEDS, QUICK_EPOCHS = [0, 1, 2], 8
EVAL_EVERY = 4  # steps; one epoch of the 256-question methods
LABELED_RATIO = 0.25  # 64 of the 256 training questions
PAPER_FIG4_GAP = 0.40  # Figure 4: top 10% by TCS beat the bottom 10% by over 40 points

# method -> (setting, trainer overrides); setting "id": unlabeled questions are subtractions, "ood": additions
METHODS = {
    "supervised": ("id", ["mode=supervised"]),
    "unsupervised": ("id", ["mode=unsupervised"]),
    "naive_semi": ("id", ["mode=naive_semi"]),
    "trapo": ("id", ["mode=trapo"]),
    "trapo_random": ("id", ["mode=trapo", "selection.strategy=random"]),
    "naive_semi_ood": ("ood", ["mode=naive_semi"]),
    "trapo_ood": ("ood", ["mode=trapo"]),
}
LABELS = {
    "supervised": "Supervised, 64 labeled only",
    "unsupervised": "Unsupervised TTRL, all 256",
    "naive_semi": "Naive semi-supervised",
    "trapo": "TraPO",
    "trapo_random": "TraPO, random selection",
    "naive_semi_ood": "Naive semi-supervised, unlabeled OOD",
    "trapo_ood": "TraPO, unlabeled OOD",
}
PROTOCOLS = ("equal_epochs", "equal_steps")
RULES = ("best_validation", "last")
# (name, method, baseline, test split): "method beats baseline" on that split's accuracy.
CLAIMS = [
    ("trapo_beats_supervised_id", "trapo", "supervised", "test"),
    ("trapo_beats_naive_semi_id", "trapo", "naive_semi", "test"),
    ("trapo_beats_unsupervised_id", "trapo", "unsupervised", "test"),
    ("trapo_beats_random_selection_id", "trapo", "trapo_random", "test"),
    ("trapo_beats_supervised_ood", "trapo", "supervised", "test_ood"),
    ("trapo_beats_naive_semi_ood", "trapo", "naive_semi", "test_ood"),
    ("trapo_beats_unsupervised_ood", "trapo", "unsupervised", "test_ood"),
    ("ood_setting_trapo_beats_supervised_id", "trapo_ood", "supervised", "test"),
    ("ood_setting_trapo_beats_naive_semi_id", "trapo_ood", "naive_semi_ood", "test"),
    ("ood_setting_trapo_beats_supervised_ood", "trapo_ood", "supervised", "test_ood"),
    ("ood_setting_trapo_beats_naive_semi_ood", "trapo_ood", "naive_semi_ood", "test_ood"),
]


# ---------------------------------------------------------------- statistics (pure)


def t_cdf(x: float, df: int) -> float:
    """Student t distribution function, by Simpson's rule on the density (|error| < 1e-9 for df >= 1)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    # substitute u = atan(t) so the heavy tail maps to a finite interval
    upper, n = math.atan(x), 4000
    h = upper / n

    def f(u: float) -> float:
        t = math.tan(u)
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df)) / math.cos(u) ** 2

    total = f(0.0) + f(upper) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return 0.5 + total * h / 3


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t (0.5 < p < 1), by bisection on `t_cdf`."""
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_interval(diffs: list[float], level: float = 0.95) -> dict:
    """Mean of paired differences and its two-sided t interval (n - 1 degrees of freedom)."""
    n = len(diffs)
    mean = statistics.mean(diffs)
    if n < 2:
        return {"mean": mean, "low": -math.inf, "high": math.inf, "n": n}
    half = t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def verdict(interval: dict, threshold: float = 0.0) -> str:
    """held: the interval lies above `threshold`; not held: below it; else inconclusive."""
    if interval["low"] > threshold:
        return "held"
    if interval["high"] < threshold:
        return "not held"
    return "inconclusive"


# ---------------------------------------------------------------- protocol read-out (pure)


def steps_per_epoch(method: str) -> int:
    """Steps of one pass over the method's own training set: 64 questions per step."""
    return 1 if method == "supervised" else 4


def budgets(epochs: int) -> dict[str, dict[str, int]]:
    """protocol -> method -> its step budget."""
    longest = epochs * max(steps_per_epoch(m) for m in METHODS)
    return {
        "equal_epochs": {m: epochs * steps_per_epoch(m) for m in METHODS},
        "equal_steps": {m: longest for m in METHODS},
    }


def read_out(curve: list[dict], budget: int, rule: str) -> dict:
    """The evaluated point a rule picks within `budget` steps.

    curve: rows {"step", "validation", "test", "test_ood"} in step order.
    best_validation: the highest validation score (ties: the earlier step); last: the step == budget.
    """
    points = [c for c in curve if c["step"] <= budget]
    if rule == "last":
        if not points or points[-1]["step"] != budget:
            raise ValueError(f"no evaluation at step {budget} (evaluated: {[c['step'] for c in curve]})")
        return points[-1]
    if rule == "best_validation":
        best = points[0]
        for c in points[1:]:
            if c["validation"] > best["validation"]:
                best = c
        return best
    raise ValueError(f"unknown rule {rule}")


def decile_accuracy(row: dict) -> tuple[list[bool], list[bool]] | None:
    """(top 10%, bottom 10%) pseudo-label correctness by TCS in one selection.jsonl row; None under 10 known."""
    pairs = sorted((t, c) for t, c in zip(row["tcs"], row["pseudo_correct"]) if c is not None)
    k = len(pairs) // 10
    if k == 0:
        return None
    return [c for _, c in pairs[-k:]], [c for _, c in pairs[:k]]


def selected_accuracy(row: dict) -> list[bool]:
    """Pseudo-label correctness of the questions the gate selected in one selection.jsonl row."""
    return [c for c, s in zip(row["pseudo_correct"], row["selected"]) if s and c is not None]


def _mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def figure4(trapo_rows: list[dict], random_rows: list[dict]) -> dict:
    """One seed's Figure 4: per epoch and pooled, top/bottom 10% by TCS and the random control's accuracy."""
    per_epoch, top_all, bottom_all, rand_all = [], [], [], []
    random_by_epoch = {r["epoch"]: selected_accuracy(r) for r in random_rows}
    for row in trapo_rows:
        dec = decile_accuracy(row)
        if dec is None:
            continue
        top, bottom = dec
        rand = random_by_epoch.get(row["epoch"], [])
        top_all += top
        bottom_all += bottom
        rand_all += rand
        per_epoch.append({"epoch": row["epoch"], "top10": _mean(top), "bottom10": _mean(bottom), "random": _mean(rand)})
    return {"per_epoch": per_epoch, "top10": _mean(top_all), "bottom10": _mean(bottom_all), "random": _mean(rand_all)}


# ---------------------------------------------------------------- runs


def build_base(docs_toy: dict, assets: Path, log) -> Path:
    """The one base model and its splits (trapo/commands/toy.py), built once from toy seed 0."""
    from trapo.commands.toy import build_assets
    from trapo.config import ToyConfig

    return build_assets(ToyConfig(**{**docs_toy, "enabled": True, "dir": str(assets), "seed": 0}), log=log)


def ood_train_file(root: Path, seed: int, dest: Path) -> Path:
    """The OOD setting's training file for a seed: the ID setting's 64 labeled + the unlabeled additions."""
    from trapo.data import load_questions

    labeled = [q for q in load_questions([str(root / "train.jsonl")], LABELED_RATIO, seed) if q.labeled]
    rows = [
        {"id": q.uid.split(":", 1)[1], "question": q.question, "answer": q.answer, "labeled": True} for q in labeled
    ]
    rows += [json.loads(x) for x in (root / "unlabeled_ood.jsonl").read_text().splitlines()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


def run_one(out: Path, root: Path, method: str, seed: int, steps: int, extra: list[str], log) -> Path:
    run_dir = out / "runs" / f"{method}-seed{seed}"
    if (run_dir / "summary.json").is_file():
        import yaml

        done = yaml.safe_load((run_dir / "config.yaml").read_text())
        if done["max_steps"] == steps:
            log(f"{method} seed {seed}: reusing {run_dir}")
            return run_dir
        log(f"{method} seed {seed}: {run_dir} ran {done['max_steps']} steps, not {steps}: running again")
    if run_dir.exists():  # interrupted, or another budget: start it again from scratch
        shutil.rmtree(run_dir)
    setting, overrides = METHODS[method]
    if setting == "ood":
        train = [f"data.train_files=[{ood_train_file(root, seed, out / 'splits' / f'ood-seed{seed}.jsonl')}]"]
    else:
        train = [f"data.train_files=[{root / 'train.jsonl'}]", f"data.labeled_ratio={LABELED_RATIO}"]
    splits = ",".join(str(root / f"{name}.jsonl") for name in ("validation", "test", "test_ood"))
    args = [
        f"run_name={run_dir.name}",
        f"output_dir={run_dir.parent}",
        f"seed={seed}",
        f"max_steps={steps}",
        "progress_bar=false",
        "toy.enabled=false",
        f"model.path={root / 'model'}",
        *train,
        f"eval.files=[{splits}]",
        "eval.select_on=validation",
        f"eval.steps={EVAL_EVERY}",
        *overrides,
        *extra,
    ]
    started = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "trapo_train.py"), "--config", str(CONFIG), *args]
    proc = subprocess.run(cmd, env=runtime.subprocess_env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log(f"{method} seed {seed}: {time.perf_counter() - started:.0f} s")
    return run_dir


def base_eval(out: Path, root: Path, cfg: dict, log) -> dict:
    """The base model under the runs' evaluation protocol (a reference row; not a candidate checkpoint)."""
    dest = out / "base"
    if not (dest / "results.json").is_file():
        ev = cfg["eval"]
        cmd = [
            sys.executable,
            "-m",
            "trapo",
            "eval",
            "--model",
            str(root / "model"),
            "--benchmarks",
            ",".join(str(root / f"{n}.jsonl") for n in ("validation", "test", "test_ood")),
            "--n",
            str(ev["n"]),
            "--temperature",
            str(ev["temperature"]),
            "--max-tokens",
            str(cfg["rollout"]["max_tokens"]),
            "--template",
            cfg["data"]["prompt_template"],
            "--max-prompt-tokens",
            str(cfg["data"]["max_prompt_tokens"]),
            "--seed",
            "0",
            "--out",
            str(dest),
            "--overwrite",
        ]
        proc = subprocess.run(cmd, env=runtime.subprocess_env(), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"base model evaluation failed:\n{proc.stderr[-3000:]}")
        log("base model evaluated")
    res = json.loads((dest / "results.json").read_text())["results"]
    return {name: r["score"] for name, r in res.items()}


def read_run(run_dir: Path) -> dict:
    """A run's evaluation curve and selection rows."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [
        {"step": m["step"], **{k: m["eval"][k] for k in ("validation", "test", "test_ood")}}
        for m in rows
        if "eval" in m
    ]
    sel = run_dir / "selection.jsonl"
    selection = [json.loads(x) for x in sel.read_text().splitlines()] if sel.is_file() else []
    return {"curve": curve, "selection": selection}


# ---------------------------------------------------------------- analysis


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def analyse(data: dict, seeds: list[int], epochs: int, base: dict) -> dict:
    """results.json: budgets and per-method figures per protocol and read-out, the claims, Figure 4."""
    methods = [m for m in METHODS if all((m, s) in data for s in seeds)]
    plan = budgets(epochs)
    protocols = {}
    for p in PROTOCOLS:
        figures = {}
        for m in methods:
            figures[m] = {"steps": plan[p][m]}
            for rule in RULES:
                picked = [read_out(data[(m, s)]["curve"], plan[p][m], rule) for s in seeds]
                figures[m][rule] = {"step": [c["step"] for c in picked]}
                for split in ("validation", "test", "test_ood"):
                    xs = [c[split] for c in picked]
                    figures[m][rule][split] = {
                        "mean": statistics.mean(xs),
                        "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                        "per_seed": xs,
                    }
        protocols[p] = {"epochs": epochs, "steps": plan[p], "methods": figures}
    claims = []
    for name, method, baseline, split in CLAIMS:
        if method not in methods or baseline not in methods:
            continue
        for p in PROTOCOLS:
            for rule in RULES:
                a = protocols[p]["methods"][method][rule][split]["per_seed"]
                b = protocols[p]["methods"][baseline][rule][split]["per_seed"]
                diffs = [x - y for x, y in zip(a, b)]
                ci = paired_interval(diffs)
                claims.append(
                    {
                        "claim": name,
                        "method": method,
                        "baseline": baseline,
                        "split": split,
                        "protocol": p,
                        "rule": rule,
                        "differences": diffs,
                        **ci,
                        "verdict": verdict(ci),
                    }
                )
    fig4 = {}
    if "trapo" in methods:
        per_seed = {
            s: figure4(data[("trapo", s)]["selection"], data.get(("trapo_random", s), {"selection": []})["selection"])
            for s in seeds
        }
        fig4 = {"per_seed": {str(s): v for s, v in per_seed.items()}}
        gaps = [v["top10"] - v["bottom10"] for v in per_seed.values() if not math.isnan(v["top10"])]
        vs_random = [v["top10"] - v["random"] for v in per_seed.values() if not math.isnan(v["random"] + v["top10"])]
        for name, diffs, threshold in (
            ("figure4_top10_beats_bottom10", gaps, 0.0),
            ("figure4_gap_exceeds_paper_40", gaps, PAPER_FIG4_GAP),
            ("figure4_top10_beats_random_selection", vs_random, 0.0),
        ):
            if diffs:
                ci = paired_interval(diffs)
                claims.append(
                    {
                        "claim": name,
                        "protocol": "both",
                        "rule": "pooled epochs after warm-up",
                        "threshold": threshold,
                        "differences": diffs,
                        **ci,
                        "verdict": verdict(ci, threshold),
                    }
                )
    return {
        "plan": {
            "epochs": epochs,
            "eval_every_steps": EVAL_EVERY,
            "labeled_ratio": LABELED_RATIO,
            "interval": "95% paired t, n-1 degrees of freedom",
            "criteria": "held: interval above the threshold (0 unless stated); not held: below; else inconclusive",
        },
        "seeds": seeds,
        "base_model": base,
        "protocols": protocols,
        "claims": claims,
        "figure4": fig4,
    }


def figure4_epoch_means(res: dict) -> list[dict]:
    """Figure 4 per epoch, each series averaged over the seeds that have it.

    Returns [{"epoch", "top10", "bottom10", "random"}], as long as the shortest seed's series.
    """
    rows = [v["per_epoch"] for v in res["figure4"].get("per_seed", {}).values()]
    return [
        {
            "epoch": rows[0][i]["epoch"],
            **{k: _mean([r[i][k] for r in rows if not math.isnan(r[i][k])]) for k in ("top10", "bottom10", "random")},
        }
        for i in range(min(map(len, rows)) if rows else 0)
    ]


def markdown(res: dict) -> str:
    seeds, protos = res["seeds"], res["protocols"]
    methods = list(protos["equal_steps"]["methods"])
    b = res["base_model"]
    md = [
        f"Seeds {', '.join(map(str, seeds))} (paired: one base model; a seed sets the labeled split and the RL "
        f"randomness). {res['plan']['epochs']} epochs; evaluation every {res['plan']['eval_every_steps']} steps, "
        "avg@4 at T = 0.6. Accuracy in %, mean ± sd over seeds.",
        "",
        f"Base model (reference, not a candidate checkpoint): validation {_pct(b['validation'])}, "
        f"ID test {_pct(b['test'])}, OOD test {_pct(b['test_ood'])}.",
        "",
    ]
    titles = {
        "equal_epochs": "(a) Equal epochs (the paper's protocol)",
        "equal_steps": "(b) Equal steps (equal rollout compute)",
    }
    for p in PROTOCOLS:
        md += [
            f"**{titles[p]}**",
            "",
            "| Method | steps | ID, best val. | ID, last | OOD, best val. | OOD, last |",
            "|---|---|---|---|---|---|",
        ]
        for m in methods:
            f = protos[p]["methods"][m]
            cells = [f"{_pct(f[r][s]['mean'])} ± {_pct(f[r][s]['sd'])}" for s in ("test", "test_ood") for r in RULES]
            md.append(f"| {LABELS[m]} | {f['steps']} | " + " | ".join(cells) + " |")
        md.append("")
    md += [
        "**Claims** (mean paired difference in points [95% paired-t interval] -> verdict)",
        "",
        "| Claim | equal epochs, best val. | equal epochs, last | equal steps, best val. | equal steps, last |",
        "|---|---|---|---|---|",
    ]
    by_claim: dict[str, dict] = {}
    for c in res["claims"]:
        by_claim.setdefault(c["claim"], {})[(c["protocol"], c["rule"])] = c

    def cell(c: dict) -> str:
        return f"{100 * c['mean']:+.1f} [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}] **{c['verdict']}**"

    for name, cs in by_claim.items():
        if name.startswith("figure4"):
            continue
        md.append(f"| {name} | " + " | ".join(cell(cs[(p, r)]) for p in PROTOCOLS for r in RULES) + " |")
    fig4 = res["figure4"]
    if fig4:
        md += [
            "",
            "**Figure 4** (pseudo-label accuracy of unlabeled questions, TraPO runs, epochs after warm-up; "
            "random: the questions the random-selection run picked at the same ratio)",
            "",
            "| Epoch | top 10% by TCS | bottom 10% by TCS | random selection |",
            "|---|---|---|---|",
        ]
        for e in figure4_epoch_means(res):
            md.append(f"| {e['epoch']} | {_pct(e['top10'])} | {_pct(e['bottom10'])} | {_pct(e['random'])} |")
        md.append("")
        for name, cs in by_claim.items():
            if name.startswith("figure4"):
                c = next(iter(cs.values()))
                md.append(f"- {name} (threshold {100 * c['threshold']:.0f} points): {cell(c)}")
    md += [
        "",
        "![accuracy over steps](accuracy_over_steps.png)",
        "![Figure 4](figure4.png)",
        "![paired differences](paired_differences.png)",
    ]
    return "\n".join(md) + "\n"


def plots(res: dict, data: dict, docs: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds, methods = res["seeds"], list(res["protocols"]["equal_steps"]["methods"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, split in zip(axes, ("validation", "test", "test_ood")):
        for m in methods:
            curves = [data[(m, s)]["curve"] for s in seeds]
            steps = [c["step"] for c in curves[0]]
            ax.plot(
                steps,
                [100 * _mean([c[i][split] for c in curves]) for i in range(len(steps))],
                marker=".",
                label=LABELS[m],
            )
        ax.axvline(res["protocols"]["equal_epochs"]["steps"]["supervised"], color="grey", ls=":", lw=1)
        ax.set_title(f"{split} accuracy (mean over seeds); dotted: supervised's equal-epoch budget", fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("avg@4 (%)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(docs / "accuracy_over_steps.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    epochs = figure4_epoch_means(res)
    for key, color, label in (
        ("top10", "tab:green", "top 10% by TCS"),
        ("bottom10", "tab:red", "bottom 10% by TCS"),
        ("random", "tab:grey", "random selection (control run)"),
    ):
        ax.plot([e["epoch"] for e in epochs], [100 * e[key] for e in epochs], marker="o", color=color, label=label)
    ax.set_title("Figure 4 at toy scale (paper: top beats bottom by > 40 points)", fontsize=9)
    ax.set_xlabel("epoch (after warm-up)")
    ax.set_ylabel("pseudo-label accuracy (%), mean over seeds")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(docs / "figure4.png", dpi=110)
    plt.close(fig)

    claims = [c for c in res["claims"] if not c["claim"].startswith("figure4")]
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.22 * len(claims))))
    colors = {
        ("equal_epochs", "best_validation"): "tab:blue",
        ("equal_epochs", "last"): "tab:cyan",
        ("equal_steps", "best_validation"): "tab:orange",
        ("equal_steps", "last"): "tab:olive",
    }
    for i, c in enumerate(claims):
        y = len(claims) - i
        ax.errorbar(
            100 * c["mean"],
            y,
            xerr=[[100 * (c["mean"] - c["low"])], [100 * (c["high"] - c["mean"])]],
            fmt="o",
            color=colors[(c["protocol"], c["rule"])],
            ms=3,
        )
    ax.set_yticks([len(claims) - i for i in range(len(claims))])
    ax.set_yticklabels([f"{c['claim']} ({c['protocol']}, {c['rule']})" for c in claims], fontsize=5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("paired difference (points), 95% t interval")
    fig.tight_layout()
    fig.savefig(docs / "paired_differences.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
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
        toy.update(labeled=16, unlabeled=48, test=16, validation=16, unlabeled_ood=48, sft_steps=100)
        extra = ["train.rollout_batch_size=16", "train.update_batch_size=16", "selection.warmup_epochs=1", *extra]

    def log(msg: str) -> None:
        print(f"[reproduce] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    root = build_base(toy, out / "base-assets", log)
    steps = budgets(epochs)["equal_steps"]
    jobs = [(m, s) for s in seeds for m in methods]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {key: pool.submit(run_one, out, root, key[0], key[1], steps[key[0]], extra, log) for key in jobs}
        runs = {key: f.result() for key, f in futures.items()}
    data = {key: read_run(d) for key, d in runs.items()}
    res = analyse(data, seeds, epochs, base_eval(out, root, cfg, log))
    res["minutes"] = round((time.perf_counter() - started) / 60, 1)
    (docs / "results.json").write_text(json.dumps(res, indent=1))
    (docs / "results.md").write_text(markdown(res))
    plots(res, data, docs)
    print(markdown(res))
    log(f"done in {res['minutes']} min; results in {docs}, runs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
