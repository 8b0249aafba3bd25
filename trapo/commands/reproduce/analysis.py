"""The reproduction's statistics and analysis (pure: no runs, no files): the Student t distribution,
paired intervals and verdicts, the protocol read-outs of an evaluation curve, Figure 4's accuracy by TCS
decile, and `analyse`, which turns the runs' curves and selection rows into results.json."""

from __future__ import annotations

import math
import statistics

from trapo.commands.reproduce.plan import (
    CLAIMS,
    EVAL_EVERY,
    LABELED_RATIO,
    METHODS,
    PAPER_FIG4_GAP,
    PROTOCOLS,
    RULES,
    budgets,
)

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


def selection_precision(rows: list[dict]) -> dict[str, list[bool]]:
    """Pseudo-label correctness pooled over selection.jsonl rows: the top and bottom 10% by TCS
    (`decile_accuracy`), and the questions the gate selected (`selected_accuracy`) and rejected (golds unknown
    left out)."""
    out: dict[str, list[bool]] = {"top10": [], "bottom10": [], "selected": [], "rejected": []}
    for row in rows:
        if (dec := decile_accuracy(row)) is not None:
            out["top10"] += dec[0]
            out["bottom10"] += dec[1]
        out["selected"] += selected_accuracy(row)
        out["rejected"] += [c for c, s in zip(row["pseudo_correct"], row["selected"]) if not s and c is not None]
    return out


def mean(xs: list) -> float:
    """The mean of xs; NaN when there is none (shared by the analysis and the plots)."""
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
        per_epoch.append({"epoch": row["epoch"], "top10": mean(top), "bottom10": mean(bottom), "random": mean(rand)})
    return {"per_epoch": per_epoch, "top10": mean(top_all), "bottom10": mean(bottom_all), "random": mean(rand_all)}


# ---------------------------------------------------------------- analysis


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
            **{k: mean([r[i][k] for r in rows if not math.isnan(r[i][k])]) for k in ("top10", "bottom10", "random")},
        }
        for i in range(min(map(len, rows)) if rows else 0)
    ]
