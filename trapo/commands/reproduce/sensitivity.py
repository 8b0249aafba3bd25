"""The five toy studies as one set (configs/studies/toy/): run them, keep their results in one file, and write
the page and its plots from that file alone.

    python -m trapo reproduce --studies configs/studies/toy --docs docs/reproduce-toy [--quick] [--jobs 2]
    python -m trapo reproduce --render docs/reproduce-toy        # the page and plots again, from the file

`--quick`: the quick seeds, half the steps, runs in their own store (outputs/studies-quick), results there.

`--studies` runs every study of the directory in ORDER through `study.run_study` (a condition two studies
share runs once; finished runs are kept, killed ones resume), then writes `<docs>/sensitivity.json`:
each study's analysis (conditions x seeds, claims with paired intervals and verdicts), the knob's value per
condition, and the runs' times read from their own files. `render` then writes `sensitivity.md` and one plot
per study (`sensitivity_<study>.png`) from that JSON, so the committed page is reproducible from the
committed results.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

from trapo.commands.reproduce import records
from trapo.commands.reproduce.analysis import t_quantile
from trapo.commands.reproduce.study import launches, load_study, run_study
from trapo.commands.reproduce.study_file import knob_setting

ORDER = ("top_p", "gamma", "warmup", "select_method", "random_select")
RESULTS = "sensitivity.json"
PAGE = "sensitivity.md"


def knob_values(study) -> dict[str, float] | None:
    """{condition: the knob's value} (the plot's x axis), or None for a study without a knob (load_study has
    checked that every condition sets it to a number)."""
    if not study.knob:
        return None
    return {name: float(knob_setting(overrides, study.knob)) for name, overrides in study.conditions.items()}


def run_times(run_dirs: list[Path]) -> dict:
    """The runs' wall times from their own files: each from its first start (starts.jsonl) to its
    summary.json; and the span from the earliest start to the latest end (runs side by side)."""
    spans = [records.span(d) for d in run_dirs]
    return {
        "runs": len(spans),
        "run_seconds_mean": sum(end - start for start, end in spans) / len(spans),
        "span_seconds": max(end for _, end in spans) - min(start for start, _ in spans),
    }


def run_set(directory: Path, out: Path, docs: Path, quick: bool, jobs: int, log) -> Path:
    """Every study of `directory` (ORDER first), then `<docs>/sensitivity.json`; returns its path."""
    studies = [load_study(directory / f"{name}.yaml") for name in ORDER if (directory / f"{name}.yaml").is_file()]
    results, dirs = [], set()
    for study in studies:
        seeds = study.seeds_for(quick)
        if quick:  # half the steps: a smoke check of the whole set (warm-ups past the budget select nothing)
            half = max(study.eval_every, study.steps // 2 // study.eval_every * study.eval_every)
            study = dataclasses.replace(study, steps=half)
        res = run_study(study, out / study.name, seeds, jobs, False, log)
        res["knob_values"] = knob_values(study)
        res["file"] = study.path
        results.append(res)
        dirs |= {d for _, _, d, _ in launches(study, out / study.name, seeds)}
    docs.mkdir(parents=True, exist_ok=True)
    path = docs / RESULTS
    path.write_text(json.dumps({"studies": results, "time": run_times(sorted(dirs)), "quick": quick}, indent=1))
    return path


# ----------------------------------------------------------------------------- the page (from the file alone)


def _interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half width of the t interval over seeds (not paired: a condition's own spread)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def _series(names: list[str]) -> dict[str, list[tuple[int, str]]] | None:
    """{strategy: [(ratio, condition), ...]} when every condition is named `<strategy>_<ratio>`, else None."""
    import re

    found: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        m = re.fullmatch(r"(\w+?)_(\d+)", name)
        if not m:
            return None
        found.setdefault(m[1], []).append((int(m[2]), name))
    return found


def plot(res: dict, dest: Path) -> None:
    """Figure-5 style: ID test accuracy against the knob (mean and 95% interval over seeds); a study without
    a knob gets one bar per condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["conditions"])
    stats = {n: _interval(res["conditions"][n]["test"]["per_seed"]) for n in names}
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    series = _series(names)
    knob = res.get("knob_values")
    if series:  # strategy_ratio conditions: one line per strategy against the ratio
        for shift, (strategy, points) in zip((-0.006, 0.006, 0.0, 0.012), series.items()):
            xs = [(knob[n] if knob else ratio / 100) + shift for ratio, n in points]
            ax.errorbar(
                xs,
                [100 * stats[n][0] for _, n in points],
                yerr=[100 * stats[n][1] for _, n in points],
                marker="o",
                capsize=4,
                label=strategy,
            )
        ax.set_xticks(sorted({knob[n] if knob else ratio / 100 for pts in series.values() for ratio, n in pts}))
        ax.set_xlabel(res["knob"] or "share of unlabeled questions selected")
        ax.legend()
    elif knob:
        xs = [knob[n] for n in names]
        ax.errorbar(
            xs, [100 * stats[n][0] for n in names], yerr=[100 * stats[n][1] for n in names], marker="o", capsize=4
        )
        ax.set_xlabel(res["knob"] + (" (toy epochs)" if res["knob"].endswith("warmup_epochs") else ""))
        ax.set_xticks(xs)
    else:  # one point per condition
        ax.errorbar(
            range(len(names)),
            [100 * stats[n][0] for n in names],
            yerr=[100 * stats[n][1] for n in names],
            fmt="o",
            capsize=4,
        )
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylabel("ID test accuracy, % (best validation step)")
    ax.set_title("\n".join(textwrap.wrap(res["title"].replace(" (toy)", ""), 60)), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def page(data: dict) -> str:
    """sensitivity.md's results part: per study the plot, a table and the claims."""
    t = data["time"]
    md = [
        f"{t['runs']} distinct runs; each took {t['run_seconds_mean']:.0f} s on average; first start to last end "
        f"{t['span_seconds'] / 60:.1f} minutes (runs two at a time; the base model's build comes before).",
        "",
    ]
    for res in data["studies"]:
        seeds = ", ".join(map(str, res["seeds"]))
        md += [
            f"### {res['title']}",
            "",
            f"`{res['file']}`; seeds {seeds}; {res['steps']} steps; test accuracy "
            "at each run's best validation step, mean ± 95% interval over seeds.",
            "",
            f"![{res['study']}](sensitivity_{res['study']}.png)",
            "",
            "| condition | ID test, % | OOD test, % |",
            "|---|---|---|",
        ]
        for name, c in res["conditions"].items():
            cells = []
            for split in ("test", "test_ood"):
                m, h = _interval(c[split]["per_seed"])
                cells.append(f"{_pct(m)} ± {_pct(h)}" if not math.isnan(h) else _pct(m))
            md.append(f"| {name} | " + " | ".join(cells) + " |")
        md += [
            "",
            "| claim | what it means on the toy | difference, points [95% paired interval] | verdict |",
            "|---|---|---|---|",
        ]
        for c in res["claims"]:
            i = c["interval"]
            md.append(
                f"| {c['name']} | {c.get('means', '')} | {100 * i['mean']:+.1f} [{100 * i['low']:+.1f}, "
                f"{100 * i['high']:+.1f}] | **{c['verdict']}** |"
            )
        md.append("")
    return "\n".join(md)


BEGIN, END = "<!-- sensitivity results: begin -->", "<!-- sensitivity results: end -->"


def render(docs: Path) -> Path:
    """The page's results block and the plots, from `<docs>/sensitivity.json` alone. The page's own text
    (the plan, what the toy cannot show) stays; the block between the markers is rewritten."""
    data = json.loads((docs / RESULTS).read_text())
    for res in data["studies"]:
        plot(res, docs / f"sensitivity_{res['study']}.png")
    path = docs / PAGE
    text = path.read_text() if path.is_file() else f"# Sensitivity studies on the toy\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path}: the markers {BEGIN} and {END} are missing; the results go between them")
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{page(data)}\n{END}{rest.split(END, 1)[1]}")
    return path


def main(args) -> int:
    """`reproduce --studies DIR [--docs D] [--quick]`, or `reproduce --render D`."""
    import sys

    from trapo.commands.reproduce.forking import RunFailed
    from trapo.config import ConfigError

    if args.render:
        print(f"wrote {render(args.render)}")
        return 0
    quick = args.quick
    out = args.out or Path("outputs/studies-quick" if quick else "outputs/studies")  # quick runs: their own store
    docs = args.docs or out
    try:
        path = run_set(args.studies, out, docs, quick, args.jobs, lambda m: print(f"[studies] {m}", file=sys.stderr))
    except ConfigError as err:
        print(f"reproduce: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"reproduce: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path} and {render(docs)}")
    return 0
