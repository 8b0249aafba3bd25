"""The long-run report of a study with `report: long_runs` (configs/studies/long_runs.yaml): what the
entropy bonus does to a run that trains past the demo's length, per condition and paired seed.

Per run (its metrics.jsonl, summary.json and log.txt): the truncated share (responses cut at rollout.max_tokens)
and the mean token entropy of every step; their median / mean over the last TAIL steps; the greedy held-out
accuracy before and after (the trainer's summary; ID test); the precision of the pseudo-labels TCS selected and
rejected at the last epoch end; the first step whose truncated share passed 0.5 and the step of the rambling
guard's warning (trapo/training/rambling.py), if any. Claims with a `metric` are read as every study's: per seed
better - worse (truncated and entropy: worse - better, lower is better), 95% paired t interval, held / not held /
inconclusive. Writes long-runs.json, long-runs.md and long-runs.png into the docs directory.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
from pathlib import Path

from trapo.commands.reproduce.analysis import paired_interval, verdict

TAIL = 50  # the last steps the truncated share and entropy are read over
LOWER_IS_BETTER = ("truncated", "entropy")
WARNING = re.compile(r"warning: step (\d+): .*entropy bonus")


def _heldout(summary: dict, key: str) -> float | None:
    scores = summary.get(key) or {}
    return scores.get("test", scores.get("mean"))


def run_values(run_dir: Path, tail: int = TAIL) -> dict:
    """One run's series and read-outs (see the module docstring)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    last = rows[-tail:]
    log = run_dir / "log.txt"
    warned = WARNING.search(log.read_text()) if log.is_file() else None
    selection = summary.get("selection") or {}
    return {
        "truncated_series": [r["truncated_frac"] for r in rows],
        "entropy_series": [r["entropy"] for r in rows],
        "truncated": statistics.median(r["truncated_frac"] for r in last),
        "entropy": statistics.mean(r["entropy"] for r in last),
        "accuracy_before": _heldout(summary, "heldout_before"),
        "accuracy": _heldout(summary, "heldout_after"),
        "precision": selection.get("precision_selected"),
        "precision_rejected": selection.get("precision_rejected"),
        "first_truncated_half": next((r["step"] for r in rows if r["truncated_frac"] > 0.5), None),
        "guard_warning_step": int(warned.group(1)) if warned else None,
    }


def analyse(study, values: dict[tuple[str, int], dict], seeds: list[int]) -> dict:
    """Per condition each read-out per seed that ran and its mean; per metric claim the paired interval over the
    seeds both conditions ran, and its verdict ("not run" without one)."""
    keys = ("truncated", "entropy", "accuracy_before", "accuracy", "precision", "precision_rejected")
    conditions = {}
    for name in study.conditions:
        ran = [s for s in seeds if (name, s) in values]
        if not ran:
            continue
        per = {k: [values[(name, s)][k] for s in ran] for k in keys}
        conditions[name] = {
            "seeds": ran,
            **{k: {"per_seed": v, "mean": statistics.mean(v) if None not in v else None} for k, v in per.items()},
            "first_truncated_half": [values[(name, s)]["first_truncated_half"] for s in ran],
            "guard_warning_step": [values[(name, s)]["guard_warning_step"] for s in ran],
        }
    claims = []
    for claim in (c for c in study.claims if "metric" in c):
        m, sign = claim["metric"], -1.0 if claim["metric"] in LOWER_IS_BETTER else 1.0
        both = [s for s in seeds if (claim["better"], s) in values and (claim["worse"], s) in values]
        if not both:
            claims.append({**claim, "interval": None, "verdict": "not run"})
            continue
        diffs = [sign * (values[(claim["better"], s)][m] - values[(claim["worse"], s)][m]) for s in both]
        interval = paired_interval(diffs)
        claims.append({**claim, "seeds": both, "interval": interval, "verdict": verdict(interval)})
    return {
        "study": study.name,
        "base": study.base,
        "title": study.title,
        "seeds": seeds,
        "steps": study.steps,
        "tail": TAIL,
        "conditions": conditions,
        "claims": claims,
        "overrides": dict(study.conditions),
        "common": list(study.common),
        "date": datetime.date.today().isoformat(),
    }


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def page(res: dict) -> str:
    """long-runs.md: the plan as the study file fixed it, then the measured tables and claims."""
    lines = [
        f"# {res['title']}",
        "",
        "Written by `python -m trapo reproduce --study configs/studies/long_runs.yaml --docs docs/reproduce-toy`"
        f" ({res['date']}); the conditions, seeds, budget and claims were fixed in that file before any run.",
        "",
        f"- Seeds {', '.join(map(str, res['seeds']))} (paired: a seed sets the labeled split and the RL randomness; "
        f"the seeds each condition ran are in the table), {res['steps']} steps each "
        f"(64 questions x 8 rollouts per step, rollout.max_tokens 12) of {res['base']} on its own toy "
        "(`trapo.commands.toy`, built once beside the runs); every condition also sets "
        f"`{' '.join(res['common'])}`.",
        "- Conditions: "
        + "; ".join(f"**{n}** `{' '.join(o) or '(the base config as it is)'}`" for n, o in res["overrides"].items()),
        f"- Read-outs per run: median truncated share and mean token entropy over the last {res['tail']} steps; "
        "greedy held-out accuracy before and after (the trainer's summary, its test split); precision of the "
        "pseudo-labels TCS selected (rejected) at the last epoch end; the first step whose truncated share "
        "passed 0.5, and the step of the rambling guard's warning.",
        "",
        "| condition | seeds | truncated (median, last steps) | entropy (nats) | held-out before | after "
        "| precision selected | rejected | truncated > 0.5 at step | guard warned at step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in res["conditions"].items():
        steps = ", ".join("-" if s is None else str(s) for s in c["first_truncated_half"])
        warned = ", ".join("-" if s is None else str(s) for s in c["guard_warning_step"])
        lines.append(
            f"| {name} | {', '.join(map(str, c['seeds']))} | {_fmt(c['truncated']['mean'])} "
            f"| {_fmt(c['entropy']['mean'])} "
            f"| {_fmt(c['accuracy_before']['mean'])} | {_fmt(c['accuracy']['mean'])} | {_fmt(c['precision']['mean'])} "
            f"| {_fmt(c['precision_rejected']['mean'])} | {steps} | {warned} |"
        )
    lines += ["", "Means over seeds; the step columns list each seed's.", ""]
    lines += ["| claim | what it means here | seeds | difference, in the claim's favour [95% interval] | verdict |"]
    lines += ["|---|---|---|---|---|"]
    for c in res["claims"]:
        i = c["interval"]
        shown = "-" if i is None else f"{i['mean']:+.3f} [{i['low']:+.3f}, {i['high']:+.3f}]"
        lines.append(
            f"| {c['name']} | {c.get('means', '')} | {', '.join(map(str, c.get('seeds', []))) or '-'} | {shown} "
            f"| {c['verdict']} |"
        )
    lines += ["", "![truncated share and entropy over steps](long-runs.png)", ""]
    return "\n".join(lines)


def plot(values: dict[tuple[str, int], dict], seeds: list[int], dest: Path) -> None:
    """Truncated share and mean token entropy against the step, mean over the seeds that ran, one line per
    condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.4))
    for name in dict.fromkeys(n for n, _ in values):
        for ax, key in zip(axes, ("truncated_series", "entropy_series")):
            runs = [values[(name, s)][key] for s in seeds if (name, s) in values]
            n = min(len(r) for r in runs)
            ax.plot(range(1, n + 1), [statistics.mean(r[i] for r in runs) for i in range(n)], label=name)
    axes[0].set_ylabel("share of responses cut at max_tokens")
    axes[1].set_ylabel("mean token entropy (nats)")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def write_report(study, values: dict[tuple[str, int], dict], docs: Path) -> str:
    """The report of the finished runs' `values` ((condition, seed) -> `run_values` of its directory, or its
    record: records.py) into `docs`; returns the page."""
    seeds = sorted({s for _, s in values})
    res = analyse(study, values, seeds)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "long-runs.json").write_text(
        json.dumps({**res, "runs": {f"{n}-seed{s}": v for (n, s), v in values.items()}})
    )
    text = page(res)
    (docs / "long-runs.md").write_text(text)
    plot(values, seeds, docs / "long-runs.png")
    return text
