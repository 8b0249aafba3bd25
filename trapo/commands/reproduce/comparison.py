"""The report of a study with `report: comparison` (configs/studies/toy/label_efficient.yaml,
configs/studies/real/comparison.yaml): methods side by side under one protocol, with what the runs that bought
labels (labels.*) bought and how precise the runs that selected pseudo-labels were.

Per run: the evaluation curve (an untrained condition's: its one evaluation), labels.jsonl when it bought labels,
selection.jsonl when it selected. Read-outs: validation, ID and OOD test accuracy at the best validation step (as
every study); labels bought, and the share of them whose pseudo-label (the majority vote at the epoch end that
bought them) was wrong: where a label corrected the reward; the selection's precision (the paper's Figure 4).
Claims are read as every study's: per seed better - worse, 95% paired t interval, held / not held /
inconclusive. Writes <name>.json, <name>.md and <name>.png into the docs directory.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from trapo.commands.reproduce.analysis import paired_interval, read_out, selection_precision, verdict
from trapo.commands.reproduce.runs import read_run
from trapo.commands.reproduce.study_report import plan_lines, result

# The selection's read-outs (analysis.selection_precision): the majority vote's accuracy in each group.
SELECTION = ("top10", "bottom10", "selected", "rejected")


def run_values(run_dir: Path) -> dict:
    """One run's evaluation curve, its purchases (labels.jsonl rows; none without labels.*) and its selection
    rows (selection.jsonl; none in a run that selected nothing)."""
    log = run_dir / "labels.jsonl"
    bought = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return {**read_run(run_dir), "bought": bought}


def _summary(values: dict, steps: int) -> dict:
    best = read_out(values["curve"], steps, "best_validation")
    out = {"best_validation": best["validation"], "best_step": best["step"], "test": best["test"]}
    out["test_ood"] = best["test_ood"]
    if values["bought"]:
        known = [c for row in values["bought"] for c in row["pseudo_correct"] if c is not None]
        out["bought"] = sum(len(row["question"]) for row in values["bought"])
        out["bought_wrong_vote"] = sum(not c for c in known) / len(known) if known else None
    return out


def analyse(study, values: dict[tuple[str, int], dict], seeds: list[int]) -> dict:
    """Per condition each read-out per seed and its mean; per claim the paired interval and its verdict."""
    per_run = {key: _summary(v, study.steps) for key, v in values.items()}
    conditions = {}
    for name in study.conditions:
        ran = [s for s in seeds if (name, s) in values]
        if not ran:
            continue
        conditions[name] = {"seeds": ran}
        for k in per_run[(name, ran[0])]:
            got = [per_run[(name, s)].get(k) for s in ran]
            got = [x for x in got if x is not None]
            conditions[name][k] = {"per_seed": got, "mean": statistics.mean(got) if got else None}
    selection = {}
    for name in study.conditions:  # pooled over seeds and epoch ends: a seed's few questions are too few alone
        rows = [row for s in seeds if (name, s) in values for row in values[(name, s)]["selection"]]
        if rows:
            picked = selection_precision(rows)
            selection[name] = {"epoch_ends": len(rows), **{k: _share(picked[k]) for k in SELECTION}}
    claims = []
    for claim in study.claims:
        both = [s for s in seeds if (claim["better"], s) in values and (claim["worse"], s) in values]
        diffs = [
            per_run[(claim["better"], s)][claim["split"]] - per_run[(claim["worse"], s)][claim["split"]] for s in both
        ]
        if not diffs:
            claims.append({**claim, "seeds": [], "interval": None, "verdict": "not run"})
            continue
        interval = paired_interval(diffs)
        claims.append(
            {**claim, "seeds": both, "differences": diffs, "interval": interval, "verdict": verdict(interval)}
        )
    seconds = [v["seconds"] for v in values.values() if v.get("seconds") is not None]  # training runs' wall times
    compute = {"runs": len(seconds), "seconds": sum(seconds)} if seconds else None
    res = result(study, seeds, conditions, claims)
    return {**res, "selection": selection, "scope": study.scope, "compute": compute}


def _claims_run(res: dict) -> bool:
    """Whether any claim has both its conditions run for some seed."""
    return any(c["interval"] is not None for c in res["claims"])


def _share(right: list[bool]) -> dict:
    """How often the majority vote was right among `right`, and of how many pseudo-labels."""
    return {"right": sum(right) / len(right) if right else None, "of": len(right)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _separable(res: dict) -> str:
    """What six seeds can resolve here: the claims' interval half-widths, measured."""
    halves = [(c["interval"]["high"] - c["interval"]["low"]) / 2 for c in res["claims"] if c["interval"] is not None]
    finite = [h for h in halves if h != float("inf")]
    if not finite:
        return "Too few seeds ran for an interval."
    return (
        f"With {len(res['seeds'])} paired seeds the claims' 95% intervals reach {100 * min(finite):.1f} to "
        f"{100 * max(finite):.1f} points either side of their mean difference (median "
        f"{100 * statistics.median(finite):.1f}): a difference smaller than that is not separated here."
    )


def _compute(res: dict) -> list[str]:
    """What the finished training runs cost, from their own files (records.span), on the machines that ran them."""
    c = res.get("compute")
    if not c:
        return []
    return [
        f"The training runs finished ({c['runs']}) took {c['seconds'] / 60 / c['runs']:.0f} min each on average, "
        f"{c['seconds'] / 3600:.1f} h in all (wall time, first start to summary; an untrained model's evaluation "
        "not counted).",
        "",
    ]


def _purchases(res: dict) -> list[str]:
    """Where each acquisition spent its labels, measured: the share bought where the vote was wrong."""
    spent = [
        f"{name} {_pct(c['bought_wrong_vote']['mean'])}"
        for name, c in res["conditions"].items()
        if c.get("bought_wrong_vote") and c["bought_wrong_vote"]["mean"] is not None
    ]
    if not spent:
        return []
    return [
        "Where the bought labels went: the share of them bought for a question whose majority vote (at the epoch "
        f"end that bought it) was wrong, so that the label changed its rewards: {', '.join(spent)}. A score can "
        "find the wrong votes without the test accuracy separating: compare with the claims above.",
        "",
    ]


def page(res: dict) -> str:
    """<name>.md: the plan as the study file fixed it, the measured tables, the claims, the plot."""
    lines = [
        *plan_lines(res),
        "",
        "| condition | seeds run | best validation | its step | ID test there | OOD test there | labels bought "
        "| bought where the vote was wrong |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in res["conditions"].items():
        bought = "-" if "bought" not in c else f"{c['bought']['mean']:.0f}"
        wrong = c.get("bought_wrong_vote")
        lines.append(
            f"| {name} | {', '.join(map(str, c['seeds']))} | {_pct(c['best_validation']['mean'])} "
            f"| {c['best_step']['mean']:.0f} "
            f"| {_pct(c['test']['mean'])} | {_pct(c['test_ood']['mean'])} "
            f"| {bought} | {_pct(wrong and wrong['mean'])} |"
        )
    lines += ["", "Means over each condition's seeds; a claim pairs the seeds both its conditions ran.", ""]
    lines += ["| claim | what it means here | difference in the claim's favour [95% paired interval] | verdict |"]
    lines += ["|---|---|---|---|"]
    for c in res["claims"]:
        i = c["interval"]
        shown = "-" if i is None else f"{100 * i['mean']:+.1f} points [{100 * i['low']:+.1f}, {100 * i['high']:+.1f}]"
        lines.append(f"| {c['name']} | {c.get('means', '')} | {shown} | **{c['verdict']}** |")
    held = [c["name"] for c in res["claims"] if c["verdict"] == "held"]
    lines += [
        "",
        f"Held: {', '.join(held)}." if held else "No claim held." if _claims_run(res) else "No claim has its runs yet.",
        "",
        "## What this scale can and cannot separate",
        "",
        _separable(res),
        "",
        *_compute(res),
        *_purchases(res),
        *([" ".join(res["scope"].split()), ""] if res.get("scope") else []),
        *_selection(res),
        f"![validation accuracy over steps; paired differences of the claims]({res['study']}.png)",
        "",
    ]
    return "\n".join(lines)


def _selection(res: dict) -> list[str]:
    """The paper's Figure 4 on the study's model: how often the majority vote was right for the unlabeled
    questions ranked top and bottom 10% by TCS, and for those the gate selected and rejected."""
    if not res.get("selection"):
        return []

    def cell(x: dict) -> str:
        return "-" if x["right"] is None else f"{_pct(x['right'])} of {x['of']}"

    lines = [
        "## The selection's precision (the paper's Figure 4)",
        "",
        "How often the majority vote (the pseudo-label) was right, pooled over the seeds and every epoch end that "
        "selected; the golds of the unlabeled questions are read only for this.",
        "",
        "| condition | epoch ends | top 10% by TCS | bottom 10% by TCS | selected | rejected |",
        "|---|---|---|---|---|---|",
    ]
    for name, sel in res["selection"].items():
        lines.append(f"| {name} | {sel['epoch_ends']} | " + " | ".join(cell(sel[k]) for k in SELECTION) + " |")
    return [*lines, ""]


def plot(res: dict, values: dict[tuple[str, int], dict], seeds: list[int], dest: Path) -> None:
    """Validation accuracy over steps (means over seeds, one line per condition) and each claim's paired
    difference with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.1]})
    for name in dict.fromkeys(n for n, _ in values):
        runs = [values[(name, s)] for s in seeds if (name, s) in values]
        points = min(len(r["curve"]) for r in runs)
        steps = [runs[0]["curve"][i]["step"] for i in range(points)]
        ys = [100 * statistics.mean(r["curve"][i]["validation"] for r in runs) for i in range(points)]
        if steps == [0]:  # an untrained condition's one evaluation: a level across the axis
            axes[0].axhline(ys[0], ls="--", lw=1, color="grey", label=name)
        else:
            axes[0].plot(steps, ys, marker="o", markersize=3, label=name)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("validation accuracy, %")
    axes[0].legend(fontsize=7, ncol=2)
    claims = [c for c in res["claims"] if c["interval"] is not None]
    for y, c in enumerate(claims):
        i = c["interval"]
        low, high = max(i["low"], -1.0), min(i["high"], 1.0)
        axes[1].errorbar(100 * i["mean"], y, xerr=[[100 * (i["mean"] - low)], [100 * (high - i["mean"])]], fmt="o")
    axes[1].axvline(0, color="grey", lw=0.8)
    axes[1].set_yticks(range(len(claims)), [c["name"] for c in claims], fontsize=7)
    axes[1].set_xlabel("test accuracy difference, points (95% paired interval)")
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
    (docs / f"{study.name}.json").write_text(json.dumps(res, indent=1))
    text = page(res)
    (docs / f"{study.name}.md").write_text(text)
    plot(res, values, seeds, docs / f"{study.name}.png")
    return text
