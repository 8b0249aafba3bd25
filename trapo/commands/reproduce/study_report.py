"""What the reports of a study (`report: efficiency`, `report: comparison`) share: the result's record of the plan
the study file fixed, and the page's opening lines that state it."""

from __future__ import annotations

import datetime

# What a study's seed sets, per scale: a toy study draws its labeled split from the seed, a cpu study's training
# file marks its labeled questions (trapo prepare), a gpu study's config says.
SEEDED = {
    "toy": "the labeled split and the RL randomness",
    "cpu": "the RL randomness (the training file marks the labeled questions)",
    "gpu": "the RL randomness and, where the config draws one, the labeled split",
}


def result(study, seeds: list[int], conditions: dict, claims: list[dict]) -> dict:
    """A report's result: the study's plan (file, base, seeds, budget, settings), the conditions' read-outs and
    the claims, dated."""
    return {
        "study": study.name,
        "title": study.title,
        "scale": study.scale,
        "base": study.base,
        "file": study.path,
        "seeds": seeds,
        "steps": study.steps,
        "eval_every": study.eval_every,
        "common": list(study.common),
        "overrides": dict(study.conditions),
        "conditions": conditions,
        "claims": claims,
        "date": datetime.date.today().isoformat(),
    }


def plan_lines(res: dict) -> list[str]:
    """The page's title and the plan as the study file fixed it: the command that wrote it, seeds, budget,
    conditions."""
    return [
        f"# {res['title']}",
        "",
        f"Written by `python -m trapo reproduce --study {res['file']} --docs <this directory>` ({res['date']}); "
        "the conditions, seeds, budget and claims were fixed in that file before any run (its comments say why "
        "each setting).",
        "",
        f"- Seeds {', '.join(map(str, res['seeds']))}, paired: a seed sets {SEEDED[res.get('scale', 'toy')]}. "
        f"{res['steps']} steps each, validation, ID and OOD test every {res['eval_every']} steps, on {res['base']} "
        f"with `{' '.join(res['common'])}`.",
        "- Conditions: "
        + "; ".join(f"**{n}** `{' '.join(o) or '(as the base)'}`" for n, o in res["overrides"].items()),
    ]
