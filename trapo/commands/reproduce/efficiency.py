"""The efficiency report of a study with `report: efficiency` (configs/studies/toy/curriculum.yaml):
what a condition costs in generation to reach an accuracy, beside what it reaches.

Per run (its metrics.jsonl): the generated response tokens of every step and their running total, the share
of rolled-out groups whose G rewards were all equal (`zero_advantage_frac`), the curriculum's skipped
questions when it ran one, and the evaluation curve (validation, ID and OOD test). Read-outs:
- tokens_to_reference_best: response tokens generated through the first evaluation whose validation accuracy
  reaches the `worse` condition's best validation accuracy of the same seed (its own run: through its best
  step). A run that never reaches it within the budget has no value: the claim's interval is then taken over
  the seeds that reached it, and the verdict cannot be "held" (those seeds would have cost more than the budget).
- zero_advantage: the mean of `zero_advantage_frac` over the run's steps.
- test accuracy at the best validation step (claims without a metric, as every study reads them).
Claims are read as every study's: per seed better - worse (for tokens and zero_advantage worse - better, as
lower is better), 95% paired t interval, held / not held / inconclusive. Writes <name>.json, <name>.md and
<name>.png into the docs directory.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from trapo.commands.reproduce.analysis import paired_interval, read_out, verdict
from trapo.commands.reproduce.study_report import plan_lines, result


def run_values(run_dir: Path) -> dict:
    """One run's series: tokens per step, their running total, zero-advantage share, skipped, the curve."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    total, cumulative = 0, []
    for r in rows:
        total += r["response_tokens"]
        cumulative.append(total)
    curve = [
        {"step": r["step"], **{k: r["eval"][k] for k in ("validation", "test", "test_ood")}}
        for r in rows
        if "eval" in r
    ]
    return {
        "tokens": [r["response_tokens"] for r in rows],
        "tokens_cumulative": cumulative,
        "zero_advantage_series": [r["zero_advantage_frac"] for r in rows],
        "skipped_series": [r.get("curriculum", {}).get("skipped_labeled", 0) for r in rows],
        "curve": curve,
    }


def tokens_to_reach(values: dict, target: float) -> int | None:
    """Tokens generated through the first evaluated step whose validation accuracy is >= target; None: never."""
    for point in values["curve"]:
        if point["validation"] >= target - 1e-12:
            return values["tokens_cumulative"][point["step"] - 1]
    return None


def _summary(values: dict, steps: int) -> dict:
    best = read_out(values["curve"], steps, "best_validation")
    return {
        "best_validation": best["validation"],
        "best_step": best["step"],
        "test": best["test"],
        "test_ood": best["test_ood"],
        "zero_advantage": statistics.mean(values["zero_advantage_series"]),
        "tokens_per_step": statistics.mean(values["tokens"]),
        "tokens_total": values["tokens_cumulative"][-1],
        "skipped_per_step": statistics.mean(values["skipped_series"]),
    }


def _claim(claim: dict, values: dict, per_run: dict, seeds: list[int]) -> dict:
    better, worse, metric = claim["better"], claim["worse"], claim.get("metric")
    both = [s for s in seeds if (better, s) in values and (worse, s) in values]
    missed = []
    if metric == "tokens_to_reference_best":
        diffs, used = [], []
        for s in both:
            target = per_run[(worse, s)]["best_validation"]
            mine, theirs = tokens_to_reach(values[(better, s)], target), tokens_to_reach(values[(worse, s)], target)
            if mine is None:
                missed.append(s)
                continue
            diffs.append(float(theirs - mine))
            used.append(s)
    elif metric == "zero_advantage":
        diffs = [per_run[(worse, s)]["zero_advantage"] - per_run[(better, s)]["zero_advantage"] for s in both]
        used = both
    else:
        split = claim["split"]
        diffs = [per_run[(better, s)][split] - per_run[(worse, s)][split] for s in both]
        used = both
    if not diffs:
        return {**claim, "seeds": [], "missed": missed, "interval": None, "verdict": "not run"}
    interval = paired_interval(diffs)
    said = verdict(interval)
    if missed and said == "held":  # the seeds that never reached the target would have cost more than the budget
        said = "inconclusive"
    return {**claim, "seeds": used, "missed": missed, "differences": diffs, "interval": interval, "verdict": said}


def analyse(study, values: dict[tuple[str, int], dict], seeds: list[int]) -> dict:
    """Per condition each read-out per seed and its mean; per claim the paired interval and its verdict."""
    per_run = {key: _summary(v, study.steps) for key, v in values.items()}
    conditions = {}
    for name in study.conditions:
        ran = [s for s in seeds if (name, s) in values]
        if ran:
            keys = per_run[(name, ran[0])]
            conditions[name] = {
                "seeds": ran,
                **{k: {"per_seed": [per_run[(name, s)][k] for s in ran]} for k in keys},
            }
            for k in keys:
                conditions[name][k]["mean"] = statistics.mean(conditions[name][k]["per_seed"])
    return result(study, seeds, conditions, [_claim(c, values, per_run, seeds) for c in study.claims])


def _interval_text(c: dict, scale: float, unit: str) -> str:
    i = c["interval"]
    if i is None:
        return "-"
    return f"{scale * i['mean']:+.1f}{unit} [{scale * i['low']:+.1f}, {scale * i['high']:+.1f}]"


def page(res: dict) -> str:
    """<name>.md: the plan as the study file fixed it, the measured tables, the claims, the plot."""
    lines = [
        *plan_lines(res),
        "- Tokens are the generated response tokens of the training rollouts (validation's are not counted).",
        "",
        "| condition | best validation | its step | ID test there | OOD test there | zero-advantage share "
        "| tokens per step | skipped labeled per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in res["conditions"].items():
        lines.append(
            f"| {name} | {100 * c['best_validation']['mean']:.1f}% | {c['best_step']['mean']:.0f} "
            f"| {100 * c['test']['mean']:.1f}% | {100 * c['test_ood']['mean']:.1f}% "
            f"| {c['zero_advantage']['mean']:.3f} | {c['tokens_per_step']['mean']:.0f} "
            f"| {c['skipped_per_step']['mean']:.1f} |"
        )
    lines += ["", "Means over seeds.", ""]
    lines += [
        "| claim | what it means here | seeds | difference in the claim's favour [95% paired interval] | verdict |"
    ]
    lines += ["|---|---|---|---|---|"]
    for c in res["claims"]:
        metric = c.get("metric")
        shown = (
            _interval_text(c, 1e-3, "k tokens")
            if metric == "tokens_to_reference_best"
            else _interval_text(c, 100, " points")
        )
        missed = f" (never reached by seed {', '.join(map(str, c['missed']))})" if c.get("missed") else ""
        lines.append(
            f"| {c['name']} | {c.get('means', '')} | {', '.join(map(str, c['seeds'])) or '-'}{missed} | {shown} "
            f"| **{c['verdict']}** |"
        )
    held = [c["name"] for c in res["claims"] if c["verdict"] == "held"]
    lines += [
        "",
        (
            f"Held: {', '.join(held)}."
            if held
            else "No claim held: at this scale and with these seeds the toy cannot show a difference."
        ),
        "",
        f"![validation accuracy against generated tokens, zero-advantage share per step]({res['study']}.png)",
        "",
    ]
    return "\n".join(lines)


def plot(values: dict[tuple[str, int], dict], seeds: list[int], dest: Path) -> None:
    """Validation accuracy against the running total of generated tokens, and the zero-advantage share per step:
    means over the seeds, one line per condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.4))
    for name in dict.fromkeys(n for n, _ in values):
        runs = [values[(name, s)] for s in seeds if (name, s) in values]
        points = min(len(r["curve"]) for r in runs)
        xs = [statistics.mean(r["tokens_cumulative"][r["curve"][i]["step"] - 1] for r in runs) for i in range(points)]
        ys = [100 * statistics.mean(r["curve"][i]["validation"] for r in runs) for i in range(points)]
        axes[0].plot([x / 1e3 for x in xs], ys, marker="o", label=name)
        n = min(len(r["zero_advantage_series"]) for r in runs)
        share = [statistics.mean(r["zero_advantage_series"][i] for r in runs) for i in range(n)]
        axes[1].plot(range(1, n + 1), share, label=name)
    axes[0].set_xlabel("generated response tokens (thousands)")
    axes[0].set_ylabel("validation accuracy, %")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("share of zero-advantage groups")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def write_report(study, values: dict[tuple[str, int], dict], docs: Path) -> str:
    """The report of the finished runs' `values` ((condition, seed) -> `run_values` of its directory, or its
    record: records.py) into `docs`; returns the page."""
    seeds = sorted({s for _, s in values})
    res = analyse(study, values, seeds)
    docs.mkdir(parents=True, exist_ok=True)
    runs = {f"{n}-seed{s}": v for (n, s), v in values.items()}
    (docs / f"{study.name}.json").write_text(json.dumps({**res, "runs": runs}))
    text = page(res)
    (docs / f"{study.name}.md").write_text(text)
    plot(values, seeds, docs / f"{study.name}.png")
    return text
