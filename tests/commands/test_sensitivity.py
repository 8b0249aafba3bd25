"""The studies as a set (trapo/commands/reproduce/sensitivity.py): the knob's value per condition comes from
the shipped files, runs' times come from their own files, and the page and its plots are written from the
results file alone, keeping the page's own text."""

import json
import os

import pytest

from trapo.commands.reproduce import sensitivity
from trapo.commands.reproduce.analysis import paired_interval, verdict
from trapo.commands.reproduce.study import load_study

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = os.path.join(ROOT, "configs", "studies", "toy")


def test_knob_values_are_read_from_the_conditions():
    assert sensitivity.knob_values(load_study(os.path.join(TOY, "top_p.yaml"))) == {
        "p0.1": 0.1,
        "p0.3": 0.3,
        "p0.5": 0.5,
        "p0.7": 0.7,
        "p1.0": 1.0,
    }
    assert sensitivity.knob_values(load_study(os.path.join(TOY, "warmup.yaml")))["w12"] == 6.0  # the toy's halving
    assert sensitivity.knob_values(load_study(os.path.join(TOY, "select_method.yaml"))) is None
    # the set is ORDER; the directory also holds the curriculum and label-efficient studies, with their own reports
    others = ["curriculum", "label_efficient"]
    assert [f.removesuffix(".yaml") for f in sorted(os.listdir(TOY))] == sorted([*sensitivity.ORDER, *others])
    assert load_study(os.path.join(TOY, "curriculum.yaml")).report == "efficiency"
    assert load_study(os.path.join(TOY, "label_efficient.yaml")).report == "comparison"


def test_run_times_come_from_each_runs_start_and_summary(tmp_path):
    for name, start, end in (("a", 1000.0, 1060.0), ("b", 1030.0, 1150.0)):
        d = tmp_path / name
        d.mkdir()
        iso = __import__("datetime").datetime.fromtimestamp(start, __import__("datetime").timezone.utc).isoformat()
        (d / "starts.jsonl").write_text(json.dumps({"time": iso}) + "\n" + json.dumps({"time": "later"}) + "\n")
        (d / "summary.json").write_text("{}")
        os.utime(d / "summary.json", (end, end))
    t = sensitivity.run_times([tmp_path / "a", tmp_path / "b"])
    assert t == {"runs": 2, "run_seconds_mean": 90.0, "span_seconds": 150.0}


def fake_study(name, knob, conditions, seeds=(0, 1, 2)):
    """An analysis as study.analyse writes it: per condition per-seed accuracies, one claim."""
    conds = {
        c: {
            s: {"per_seed": [acc + 0.01 * i for i in seeds], "mean": acc + 0.01}
            for s in ("validation", "test", "test_ood")
        }
        for c, acc in conditions.items()
    }
    better, worse = list(conditions)[:2]
    diffs = [a - b for a, b in zip(conds[better]["test"]["per_seed"], conds[worse]["test"]["per_seed"])]
    interval = paired_interval([d + 0.001 * i for i, d in enumerate(diffs)])
    claim = {
        "name": f"{better}_beats_{worse}",
        "better": better,
        "worse": worse,
        "split": "test",
        "means": f"{better} above {worse}",
        "interval": interval,
        "verdict": verdict(interval),
    }
    values = {c: float(c[1:]) for c in conditions} if knob else None
    return {
        "study": name,
        "title": f"{name} (toy)",
        "knob": knob,
        "seeds": list(seeds),
        "steps": 32,
        "conditions": conds,
        "claims": [claim],
        "knob_values": values,
        "file": f"{name}.yaml",
    }


def test_the_page_and_plots_are_written_from_the_results_file_alone(tmp_path):
    studies = [
        fake_study("top_p", "selection.top_p", {"p0.1": 0.6, "p1.0": 0.5, "p0.5": 0.55}),
        fake_study("warmup", "selection.warmup_epochs", {"w3": 0.6, "w1": 0.62}),
        fake_study("select_method", None, {"tcs": 0.6, "random": 0.58}),
    ]
    data = {"studies": studies, "time": {"runs": 7, "run_seconds_mean": 41.0, "span_seconds": 600.0}, "quick": False}
    (tmp_path / "sensitivity.json").write_text(json.dumps(data))
    (tmp_path / "sensitivity.md").write_text(
        f"# Page\n\nThe plan.\n\n{sensitivity.BEGIN}\nold\n{sensitivity.END}\n\nAfter.\n"
    )
    sensitivity.render(tmp_path)
    text = (tmp_path / "sensitivity.md").read_text()
    assert text.startswith("# Page\n\nThe plan.") and text.endswith("After.\n") and "\nold\n" not in text
    assert "7 distinct runs; each took 41 s on average; first start to last end 10.0 minutes" in text
    assert "| p0.1 | 61.0 ± 2.5 |" in text  # mean of 0.60, 0.61, 0.62; t(0.975, 2) = 4.303 x 0.01 / sqrt(3)
    assert "| p0.1_beats_p1.0 | p0.1 above p1.0 | +10.1 [+9.9, +10.3] | **held** |" in text
    assert "| w3_beats_w1 | w3 above w1 | -1.9 [-2.1, -1.7] | **not held** |" in text
    for name in ("top_p", "warmup", "select_method"):
        png = tmp_path / f"sensitivity_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"(sensitivity_{name}.png)" in text
    (tmp_path / "sensitivity.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="markers"):
        sensitivity.render(tmp_path)
