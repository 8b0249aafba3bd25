"""Per-question pass rates of an evaluation (`trapo eval --n K` samples.jsonl), by the word problems' difficulty.

Read by `python -m trapo readme --real-base EVAL_DIR` (make real-figures) for docs/real-model.md.
How a base model's pass rates spread decides whether RL can learn from a task: a question whose K samples are
all right, or all wrong, gives a group of equal rewards (zero advantage). `table` counts the questions by how
many of their K samples are right, per benchmark and per (steps, range) cell of `problems.jsonl`
(trapo/commands/word_problems.py); `plot` draws the same counts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def read(samples: Path, problems: Path | None = None) -> list[dict]:
    """One row per question: benchmark, question, k right of n, and its steps and range when `problems` (a
    problems.jsonl) holds the question."""
    cells = {}
    if problems is not None:
        for line in problems.read_text().splitlines():
            p = json.loads(line)
            cells[p["question"]] = (p["steps"], p["range"])
    rows = []
    for line in samples.read_text().splitlines():
        rec = json.loads(line)
        right = sum(bool(r["correct"]) for r in rec["responses"])
        steps, range_name = cells.get(rec["question"], (None, None))
        rows.append(
            {
                "benchmark": rec["benchmark"],
                "question": rec["question"],
                "right": right,
                "n": len(rec["responses"]),
                "steps": steps,
                "range": range_name,
                "truncated": sum(bool(r["truncated"]) for r in rec["responses"]),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: per benchmark, and per (steps, range) cell within it, the questions, their mean pass rate, the
    share whose samples are all wrong or all right, the truncated share, and how many questions have 0..n right."""
    n = max(r["n"] for r in rows)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["benchmark"], "all")].append(r)
        if r["steps"] is not None:
            groups[(r["benchmark"], f"{r['steps']} step{'s' if r['steps'] > 1 else ''}, {r['range']}")].append(r)
    head = "| split | questions | mean pass@1 | all wrong | all right | truncated | " + " | ".join(
        f"{k}/{n}" for k in range(n + 1)
    )
    lines = [head + " |", "|" + "---|" * (n + 7)]
    for (bench, cell), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all", kv[0][1])):
        counts = [sum(r["right"] == k for r in rs) for k in range(n + 1)]
        mean = sum(r["right"] / r["n"] for r in rs) / len(rs)
        cut = sum(r["truncated"] for r in rs) / sum(r["n"] for r in rs)
        label = f"**{bench}**" if cell == "all" else f"{bench}: {cell}"
        lines.append(
            f"| {label} | {len(rs)} | {mean:.3f} | {counts[0] / len(rs):.2f} | {counts[-1] / len(rs):.2f} | "
            f"{cut:.2f} | " + " | ".join(map(str, counts)) + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """A bar chart per benchmark of the questions by samples right of n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(r["n"] for r in rows)
    benches = sorted({r["benchmark"] for r in rows})
    fig, axes = plt.subplots(1, len(benches), figsize=(4 * len(benches), 3), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        rs = [r for r in rows if r["benchmark"] == bench]
        ax.bar(range(n + 1), [sum(r["right"] == k for r in rs) for k in range(n + 1)], color="tab:blue")
        ax.set_title(f"{bench} ({len(rs)} questions)")
        ax.set_xlabel(f"samples right of {n}")
        ax.set_xticks(range(n + 1))
    axes[0][0].set_ylabel("questions")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
