"""`make reproduce-toy`: the paper's three claims, checked at a scale a 2-core CPU runs.

The plan was fixed before any run (see README, "Reproducing the paper's claims on a toy"):
- task: `trap` in trapo/toy.py: two-digit subtractions, half of them with a borrow,
  where the warm start's teacher made the no-borrow error on 60% of borrow questions;
  OOD test: two-digit additions. 64 labeled + 192 unlabeled (hidden golds), 128 ID
  and 128 OOD test questions. Warm start: 3000 SFT steps, the one setting calibrated
  (on the base model alone, before any method ran) so that pass rates are not ~0:
  sampled accuracy 0.48 on no-borrow, 0.03 on borrow questions (majority answer right
  on 5% of them: the trap), 0.20 on OOD additions.
- budget, the same for every method: `--steps` (60; QUICK 30) steps of 64 questions
  x 8 rollouts, lr 2e-4, warm-up 3 epochs of the 256-question set for TraPO; held-out
  avg@4 at T = 0.6 every 10 steps; seeds 0, 1, 2 (QUICK: 0).
- methods: supervised on the 64 labeled; supervised on all 256 (upper bound);
  unsupervised TTRL on all 256; naive semi-supervised (64 labeled + TTRL on all 192
  unlabeled); TraPO; TraPO with random selection of as many unlabeled questions.

Each run is `trapo_train.py` on `configs/toy_trap.yaml`; a finished run (summary.json)
is reused, so an interrupted reproduction continues. Outputs in `--out`: results.md
(table and the three claims with their numbers), results.json, and three PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trapo import runtime

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "supervised": ["mode=supervised"],
    "supervised_all": ["mode=supervised", "data.labeled_ratio=1.0"],
    "unsupervised": ["mode=unsupervised"],
    "naive_semi": ["mode=naive_semi"],
    "trapo": ["mode=trapo"],
    "trapo_random": ["mode=trapo", "selection.random=true"],
}
LABELS = {
    "supervised": "Supervised, labeled only",
    "supervised_all": "Supervised, all labeled (upper bound)",
    "unsupervised": "Unsupervised TTRL, all questions",
    "naive_semi": "Naive semi-supervised",
    "trapo": "TraPO",
    "trapo_random": "TraPO, random selection",
}


def run_one(out: Path, method: str, seed: int, steps: int, extra: list[str], log) -> Path:
    run_dir = out / "runs" / f"{method}-seed{seed}"
    if (run_dir / "summary.json").is_file():
        import yaml

        done = yaml.safe_load((run_dir / "config.yaml").read_text())
        if done["max_steps"] == steps:
            log(f"{method} seed {seed}: reusing {run_dir}")
            return run_dir
        log(f"{method} seed {seed}: {run_dir} ran {done['max_steps']} steps, not {steps}: running again")
    if run_dir.exists():  # interrupted, or another budget: start it again from scratch
        import shutil

        shutil.rmtree(run_dir)
    args = [
        f"run_name={run_dir.name}",
        f"output_dir={run_dir.parent}",
        f"seed={seed}",
        f"toy.seed={seed}",
        f"max_steps={steps}",
        "progress_bar=false",
        *METHODS[method],
        *extra,
    ]
    started = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "trapo_train.py"), "--config", str(ROOT / "configs" / "toy_trap.yaml"), *args]
    proc = subprocess.run(cmd, env=runtime.subprocess_env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log(f"{method} seed {seed}: {time.perf_counter() - started:.0f} s")
    return run_dir


def base_eval(out: Path, run_dir: Path, seed: int, log) -> dict:
    """The warm-started model under the runs' own evaluation protocol (avg@n at T, same seeds)."""
    import yaml

    from trapo.config import ToyConfig
    from trapo.toy import asset_dir

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    root = asset_dir(ToyConfig(**cfg["toy"]))
    dest = out / "base" / f"seed{seed}"
    if not (dest / "results.json").is_file():
        ev, r = cfg["eval"], cfg["rollout"]
        cmd = [
            sys.executable,
            "-m",
            "trapo.eval",
            "--model",
            str(root / "model"),
            "--benchmarks",
            f"{root / 'test.jsonl'},{root / 'test_ood.jsonl'}",
            "--n",
            str(ev["n"]),
            "--temperature",
            str(ev["temperature"]),
            "--max-tokens",
            str(ev["max_tokens"] or r["max_tokens"]),
            "--template",
            cfg["data"]["prompt_template"],
            "--max-prompt-tokens",
            str(cfg["data"]["max_prompt_tokens"]),
            "--seed",
            str(cfg["seed"]),
            "--out",
            str(dest),
            "--overwrite",
        ]
        proc = subprocess.run(cmd, env=runtime.subprocess_env(), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"base model evaluation, seed {seed}, failed:\n{proc.stderr[-3000:]}")
        log(f"base model seed {seed} evaluated")
    res = json.loads((dest / "results.json").read_text())["results"]
    return {name: r["score"] for name, r in res.items()}


def _read(run_dir: Path, base: dict) -> dict:
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sel_file = run_dir / "selection.jsonl"
    selection = [json.loads(x) for x in sel_file.read_text().splitlines()] if sel_file.is_file() else []
    curve = [(0, base["test"], base.get("test_ood"))]
    curve += [(m["step"], m["eval"]["test"], m["eval"].get("test_ood")) for m in metrics if "eval" in m]
    epochs = [m["selection"] for m in metrics if "selection" in m]
    return {"curve": curve, "epochs": epochs, "selection": selection}


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def decile_precision(selection: list[dict], warmup_epochs: int) -> tuple[float, float, int] | None:
    """Pseudo-label precision of the top vs bottom 10% by TCS, pooled over epochs after warm-up (Figure 4)."""
    top, bottom = [], []
    for row in selection:
        if row["epoch"] < warmup_epochs:
            continue
        pairs = [(t, c) for t, c in zip(row["tcs"], row["pseudo_correct"]) if c is not None]
        if len(pairs) < 10:
            continue
        pairs.sort(key=lambda p: p[0])
        k = len(pairs) // 10
        bottom += [c for _, c in pairs[:k]]
        top += [c for _, c in pairs[-k:]]
    if not top:
        return None
    return sum(top) / len(top), sum(bottom) / len(bottom), len(top)


def _finish(fig, ax, xlabel: str, ylabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path, runs: dict, warmup_epochs: int, log=print) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({s for _, s in runs})
    base = {s: base_eval(out, next(d for (_, s2), d in runs.items() if s2 == s), s, log) for s in seeds}
    data = {(m, s): _read(d, base[s]) for (m, s), d in runs.items()}
    methods = [m for m in METHODS if any(k[0] == m for k in data)]
    rows, table = {}, []
    for m in methods:
        finals = [data[(m, s)]["curve"][-1] for s in seeds if (m, s) in data]
        idm, ids = _mean_sd([f[1] for f in finals])
        ood = [f[2] for f in finals if f[2] is not None]
        oodm, oods = _mean_sd(ood) if ood else (math.nan, 0.0)
        rows[m] = {"id": idm, "id_sd": ids, "ood": oodm, "ood_sd": oods, "seeds": len(finals)}
        table.append(f"| {LABELS[m]} | {100 * idm:.1f} ± {100 * ids:.1f} | {100 * oodm:.1f} ± {100 * oods:.1f} |")
    bid, bsd = _mean_sd([base[s]["test"] for s in seeds])
    oid, osd = _mean_sd([base[s]["test_ood"] for s in seeds])
    head = "| Method | ID accuracy (%) | OOD accuracy (%) |\n|---|---|---|\n"
    head += f"| Warm-started base model | {100 * bid:.1f} ± {100 * bsd:.1f} | {100 * oid:.1f} ± {100 * osd:.1f} |\n"
    md = head + "\n".join(table) + "\n"
    seed_list = ", ".join(map(str, seeds))
    md += f"\nMean ± standard deviation over seeds {seed_list}; held-out avg@4 at T = 0.6 after the last step.\n"
    # Per seed: each seed builds its own base model, so differences within a seed are the paired comparison.
    md += "\nPer seed, ID / OOD accuracy (%):\n\n| Method | " + " | ".join(f"seed {s}" for s in seeds) + " |\n"
    md += "|---|" + "---|" * len(seeds) + "\n"
    md += (
        "| Warm-started base model | "
        + " | ".join(f"{100 * base[s]['test']:.1f} / {100 * base[s]['test_ood']:.1f}" for s in seeds)
        + " |\n"
    )
    for m in methods:
        cells = []
        for s in seeds:
            last = data[(m, s)]["curve"][-1] if (m, s) in data else None
            cells.append(f"{100 * last[1]:.1f} / {100 * last[2]:.1f}" if last else "-")
        md += f"| {LABELS[m]} | " + " | ".join(cells) + " |\n"

    # plot 1: held-out ID accuracy over steps
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        curves = [data[(m, s)]["curve"] for s in seeds if (m, s) in data]
        steps = [c[0] for c in curves[0]]
        mean = [statistics.mean(c[i][1] for c in curves) for i in range(len(steps))]
        ax.plot(steps, [100 * x for x in mean], marker="o", label=LABELS[m])
    _finish(fig, ax, "step", "held-out ID accuracy (%)", out / "accuracy_over_steps.png")

    # plot 2: pseudo-label precision of selected vs rejected over epochs
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, style in (("trapo", "-"), ("trapo_random", "--")):
        per_seed = [data[(m, s)]["epochs"] for s in seeds if (m, s) in data]
        if not per_seed:
            continue
        n_ep = min(len(e) for e in per_seed)
        for key, color in (("precision_selected", "tab:green"), ("precision_rejected", "tab:red")):
            xs, ys = [], []
            for i in range(n_ep):
                vals = [e[i][key] for e in per_seed if e[i][key] is not None]
                if vals:
                    xs.append(per_seed[0][i]["epoch"])
                    ys.append(100 * statistics.mean(vals))
            ax.plot(xs, ys, style, color=color, marker="o", label=f"{LABELS[m]}: {key.split('_')[1]}")
    _finish(
        fig, ax, "epoch (selection made at its end)", "pseudo-label precision (%)", out / "precision_over_epochs.png"
    )

    # plot 3: TCS of questions whose pseudo-label is right vs wrong (TraPO runs, after warm-up)
    right, wrong = [], []
    for s in seeds:
        for row in data.get(("trapo", s), {"selection": []})["selection"]:
            for t, c in zip(row["tcs"], row["pseudo_correct"]):
                if c is not None:
                    (right if c else wrong).append(t)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if right or wrong:
        ax.hist(
            [right, wrong], bins=30, label=["pseudo-label right", "pseudo-label wrong"], color=["tab:green", "tab:red"]
        )
    _finish(fig, ax, "TCS (similarity used for selection)", "questions x epochs", out / "tcs_distribution.png")

    # the three claims
    claims = {}
    dec = [decile_precision(data[("trapo", s)]["selection"], warmup_epochs) for s in seeds if ("trapo", s) in data]
    dec = [d for d in dec if d]
    if dec:
        top = statistics.mean(d[0] for d in dec)
        bottom = statistics.mean(d[1] for d in dec)
        claims["1_tcs_precision"] = {
            "top10": top,
            "bottom10": bottom,
            "gap_points": 100 * (top - bottom),
            "held": top - bottom > 0.4,
        }
    if {"trapo", "supervised", "naive_semi"} <= set(rows):
        t, s_, n = rows["trapo"]["id"], rows["supervised"]["id"], rows["naive_semi"]["id"]
        claims["2_trapo_beats_baselines"] = {
            "trapo": t,
            "supervised": s_,
            "naive_semi": n,
            "held": t > s_ and t > n,
        }
    if "unsupervised" in rows:
        curves = [data[("unsupervised", s)]["curve"] for s in seeds if ("unsupervised", s) in data]
        mean = [statistics.mean(c[i][1] for c in curves) for i in range(len(curves[0]))]
        peak = max(mean)
        ood = [statistics.mean(c[i][2] for c in curves) for i in range(len(curves[0]))]
        claims["3_unsupervised_degrades"] = {
            "peak": peak,
            "peak_step": curves[0][mean.index(peak)][0],
            "final": mean[-1],
            "drop_points": 100 * (peak - mean[-1]),
            # decided before the runs: ID accuracy ends >= 2 points below an earlier peak
            "held": peak - mean[-1] >= 0.02 and mean.index(peak) < len(mean) - 1,
            "ood_start": ood[0],
            "ood_peak": max(ood),
            "ood_final": ood[-1],
        }
    md += "\n### The paper's claims at this scale\n\n"
    c1 = claims.get("1_tcs_precision")
    if c1:
        md += (
            f"1. Top 10% by TCS vs bottom 10%, pseudo-label precision: {100 * c1['top10']:.1f}% vs "
            f"{100 * c1['bottom10']:.1f}% (gap {c1['gap_points']:.1f} points; paper: over 40) -> "
            f"**{'held' if c1['held'] else 'not held'}**.\n"
        )
    c2 = claims.get("2_trapo_beats_baselines")
    if c2:
        md += (
            f"2. TraPO {100 * c2['trapo']:.1f}% vs supervised {100 * c2['supervised']:.1f}% and naive "
            f"semi-supervised {100 * c2['naive_semi']:.1f}% (ID) -> **{'held' if c2['held'] else 'not held'}**.\n"
        )
    c3 = claims.get("3_unsupervised_degrades")
    if c3:
        md += (
            f"3. Unsupervised TTRL: peak {100 * c3['peak']:.1f}% at step {c3['peak_step']}, final "
            f"{100 * c3['final']:.1f}% (drop {c3['drop_points']:.1f} points) -> "
            f"**{'held' if c3['held'] else 'not held'}** (criterion: ID accuracy ends 2 or more points below an "
            f"earlier peak). OOD accuracy of the same runs: {100 * c3['ood_start']:.1f}% at step 0, "
            f"{100 * c3['ood_final']:.1f}% at the end.\n"
        )
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"methods": rows, "claims": claims, "seeds": seeds}, indent=2))
    return {"markdown": md, "claims": claims, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, 30 steps (under 15 minutes)")
    parser.add_argument("--seeds", default=None, help="comma list (default 0,1,2; quick: 0)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 60; quick: 30)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--out", default=None, help="default outputs/reproduce-toy (quick: outputs/reproduce-toy-quick)"
    )
    parser.add_argument("--tiny", action="store_true", help="a few questions only (the test suite's smoke run)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    steps = args.steps or (30 if args.quick else 60)
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"reproduce: unknown methods {unknown}; known: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    out = Path(args.out or ("outputs/reproduce-toy-quick" if args.quick else "outputs/reproduce-toy"))
    out.mkdir(parents=True, exist_ok=True)
    extra = []
    warmup = 3
    if args.tiny:
        extra = [
            "toy.labeled=16",
            "toy.unlabeled=48",
            "toy.test=16",
            "toy.sft_steps=100",
            "train.rollout_batch_size=16",
            "train.update_batch_size=16",
            "selection.warmup_epochs=1",
            "eval.steps=1",
        ]
        warmup = 1
    extra += args.overrides

    def log(msg: str) -> None:
        print(f"[reproduce] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    runs = {(m, s): run_one(out, m, s, steps, extra, log) for s in seeds for m in methods}
    result = report(out, runs, warmup, log)
    print(result["markdown"])
    log(f"done in {(time.perf_counter() - started) / 60:.1f} min; outputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
