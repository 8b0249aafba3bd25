"""Rollout dumps: what the policy wrote and how it was scored, every `logging.rollouts_every` steps.

    dump_step(every, run_dir, step, question_ids, questions, prompts=..., decode=..., texts=..., rewards=...,
              grades=..., gate=...)

writes run_dir/rollouts/step-K.jsonl (K: the step number of metrics.jsonl,
1-based), one line per question of the step, every rank's questions gathered
to rank 0, in batch order:

    {"question": index in the training set, "uid": ..., "labeled": bool,
     "prompt": the prompt text the engine saw, "responses": [G texts],
     "rewards": [G] the rewards the advantages were computed from,
     "answers": [G] each response's extracted answer (null: none found),
     "pseudo_label": the majority answer (unlabeled; null on a tie or labeled),
     "gold": the gold answer (labeled; null for unlabeled),
     "pseudo_correct": pseudo-label == hidden gold (unlabeled with one; else null),
     "in_loss": the gate M (labeled: always; unlabeled: selected by TraPO)}

A dump is for reading, never for the run: a write that fails (disk full, a
permission) is one warning line and training goes on. The file appears
whole or not at all (written beside, then renamed), so a resumed run that
redoes a step replaces that step's file atomically.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from trapo import console


def due(every: int, step: int) -> bool:
    """Whether step (1-based) is dumped: every > 0 and step a multiple of it."""
    return every > 0 and step % every == 0


def question_rows(question_ids, questions, prompts, texts, rewards, grades, gate) -> list[dict]:
    """One rank's rows (pure). question_ids, questions, prompts (texts), gate: [b]; texts, rewards: [b][G];
    grades: the step's `trapo.training.grading.Grades` of these questions (answers [b][G], pseudo_labels [b])."""
    sizes = [len(x) for x in (question_ids, questions, prompts, texts, rewards, gate, grades.answers)]
    if len(set(sizes)) != 1:  # e.g. Grades built without the answers: say so rather than dump a misaligned file
        raise ValueError(f"rows of different lengths (questions, prompts, texts, rewards, gate, answers): {sizes}")
    rows = []
    for pos, (index, q) in enumerate(zip(question_ids, questions)):
        correct = grades.pseudo_correct[pos]
        rows.append(
            {
                "question": int(index),
                "uid": q.uid,
                "labeled": bool(q.labeled),
                "prompt": prompts[pos],
                "responses": list(texts[pos]),
                "rewards": [float(r) for r in rewards[pos]],
                "answers": list(grades.answers[pos]),
                "pseudo_label": None if q.labeled else grades.pseudo_labels[pos],
                "gold": q.answer if q.labeled else None,
                "pseudo_correct": None if q.labeled or math.isnan(correct) else bool(correct),
                "in_loss": bool(gate[pos] > 0),
            }
        )
    return rows


def write_rows(path: Path, rows: list[dict]) -> bool:
    """rows as JSON lines at path, atomically (a temporary file beside it, then a rename); False, with a
    warning line, when the write fails (not collective)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
        return True
    except OSError as err:
        console.say(f"warning: rollout dump {path} not written ({err.strerror or err}); training goes on")
        try:
            tmp.unlink(missing_ok=True)  # a half-written file would hold the disk space that ran out
        except OSError:
            pass
        return False


def dump_step(
    every: int, run_dir: Path, step: int, question_ids, questions, *, prompts, decode, texts, rewards, grades, gate
) -> Path | None:
    """Collective when `due(every, step)` (every rank calls it with its own questions): the rows gathered
    to rank 0, which writes run_dir/rollouts/step-{step}.jsonl. Returns that path on rank 0 when written.

    prompts: [b] prompt token ids, turned into text by `decode` (the tokenizer's) only on dumped steps."""
    if not due(every, step):
        return None
    from trapo.engine import dist  # torch: not for `trapo.commands.report`, which reads dumps only

    try:
        rows = question_rows(question_ids, questions, [decode(ids) for ids in prompts], texts, rewards, grades, gate)
    except Exception as err:  # noqa: BLE001 - a dump is for reading: it must not stop training (nor hang the others)
        rows = f"{type(err).__name__}: {err}"
    gathered = dist.all_gather(rows)  # every rank gets here, a failed one too: the gather is collective
    if dist.rank() != 0:
        return None
    failed = [f"rank {r}: {part}" for r, part in enumerate(gathered) if isinstance(part, str)]
    if failed:
        console.say(f"warning: rollout dump of step {step} not written ({'; '.join(failed)}); training goes on")
        return None
    # rank r holds batch[r::world]: interleaving the ranks' rows gives the batch's order back
    rows = [part[j] for j in range(max(map(len, gathered))) for part in gathered if j < len(part)]
    path = Path(run_dir) / "rollouts" / f"step-{step}.jsonl"
    return path if write_rows(path, rows) else None


def latest_dump(run_dir: Path) -> Path | None:
    """The dump of the highest step under run_dir/rollouts, or None."""
    found = []
    for path in (Path(run_dir) / "rollouts").glob("step-*.jsonl"):
        number = path.stem.removeprefix("step-")
        if number.isdigit():
            found.append((int(number), path))
    return max(found)[1] if found else None
