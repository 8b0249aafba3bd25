"""The reproduction's results for people: results.md (the tables per protocol, the claims with their
intervals and verdicts, Figure 4 per epoch) and the three plots beside it."""

from __future__ import annotations

import math
from pathlib import Path

from trapo.commands.reproduce.analysis import figure4_epoch_means, mean
from trapo.commands.reproduce.plan import LABELS, PROTOCOLS, RULES


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}"


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
                [100 * mean([c[i][split] for c in curves]) for i in range(len(steps))],
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
