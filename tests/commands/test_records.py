"""A study run in pieces on several machines (records.py): a run finished here is recorded beside the report;
on another clone (its run store empty) the record stands for the run, which is not launched again; a record of
another launch is not used; a damaged one is one line naming it."""

import dataclasses
import datetime
import json
import os
import sys

import pytest
import yaml

from trapo.commands.reproduce import comparison, records
from trapo.commands.reproduce.study import launches, load_study, report_values, unrecorded
from trapo.commands.reproduce.study_file import SPLITS
from trapo.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def real_study():
    full = load_study(os.path.join(ROOT, "configs", "studies", "real", "comparison.yaml"))
    keep = ("base", "trapo")
    claims = [c for c in full.claims if c["better"] in keep and c["worse"] in keep]
    return dataclasses.replace(full, conditions={k: full.conditions[k] for k in keep}, claims=claims)


def finish(run_dir, steps, evals, start="2026-12-07T10:00:00"):
    """A training run's files as the trainer leaves them: its config (the budget), first start, curve, summary."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"max_steps": steps}))
    (run_dir / "starts.jsonl").write_text(json.dumps({"step": 0, "time": start}) + "\n")
    rows = [{"step": s, "eval": dict(zip(SPLITS, v))} for s, v in sorted(evals.items())]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text("{}")


def evaluated(run_dir, scores):
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps({"results": {k: {"score": v} for k, v in scores.items()}}))


def test_a_run_recorded_on_one_clone_reports_on_another_and_is_not_run_again(tmp_path):
    study, docs = real_study(), tmp_path / "docs"
    here = launches(study, tmp_path / "here" / "studies" / "real_comparison", [0, 1])
    (base0, _, dir_b0, _), (_, _, dir_b1, _), (trapo0, _, dir_t0, _), (_, _, dir_t1, _) = here
    evaluated(dir_b0, {"validation": 0.25, "test": 0.2, "test_ood": 0.1})
    finish(dir_t0, study.steps, {5: (0.3, 0.25, 0.1), 10: (0.5, 0.4, 0.2), 20: (0.4, 0.9, 0.9)})
    ended = datetime.datetime.fromisoformat("2026-12-07T10:30:00").timestamp()  # 30 min after its first start
    os.utime(dir_t0 / "summary.json", (ended, ended))
    got = report_values(study, here, docs, comparison.run_values)
    assert set(got) == {(base0, 0), (trapo0, 0)}  # seed 1 neither finished nor recorded
    record = json.loads(records.path(docs, dir_t0).read_text())
    assert record["condition"] == "trapo" and record["seed"] == 0 and record["steps"] == 20
    assert got[(trapo0, 0)]["seconds"] == record["seconds"] == 1800.0 and got[(base0, 0)]["seconds"] is None
    assert all(sys.executable not in a and str(tmp_path) not in a for a in record["launch"])

    # another clone: its own store (empty), interpreter and checkout paths; the records come with the docs
    there = launches(study, tmp_path / "there" / "studies" / "real_comparison", [0, 1])
    assert [records.portable(a, d) for _, _, d, a in there] == [records.portable(a, d) for _, _, d, a in here]
    assert [(n, s) for n, s, _, _ in unrecorded(study, there, docs)] == [("base", 1), ("trapo", 1)]
    assert report_values(study, there, docs, comparison.run_values) == got
    res = comparison.analyse(study, got, [0])
    assert res["conditions"]["trapo"]["test"]["per_seed"] == [0.4]  # the best validation step's, from the record
    assert res["compute"] == {"runs": 1, "seconds": 1800.0}
    assert "The training runs finished (1) took 30 min each on average, 0.5 h in all" in comparison.page(res)

    # a changed study (another cadence: another launch) does not take the old record
    cadence = dataclasses.replace(study, eval_every=10)
    moved = launches(cadence, tmp_path / "there" / "studies" / "real_comparison", [0])
    assert [(n, s) for n, s, _, _ in unrecorded(cadence, moved, docs)] == [("trapo", 0)]  # evaluations: no cadence

    for damaged in ('{"launch": [', '{"launch": []}', "[]"):  # cut short; a JSON that is no record
        records.path(docs, dir_t0).write_text(damaged)
        with pytest.raises(ConfigError, match=f"{records.path(docs, dir_t0)}: not a run record .* delete it"):
            unrecorded(study, there, docs)
