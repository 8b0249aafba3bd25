"""The reproduction's smallest configuration end to end (the research outcome is not asserted)."""

import json
import os
import subprocess
import sys

from trapo import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reproduce_smallest_configuration(tmp_path):
    env = runtime.subprocess_env()
    out = tmp_path / "rep"
    cmd = [
        sys.executable,
        "-m",
        "trapo.reproduce",
        "--tiny",
        "--steps",
        "5",
        "--seeds",
        "0",
        "--methods",
        "supervised,unsupervised,trapo,trapo_random",
        "--out",
        str(out),
        f"toy.dir={tmp_path / 'assets'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in (
        "results.md",
        "results.json",
        "accuracy_over_steps.png",
        "precision_over_epochs.png",
        "tcs_distribution.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    md = (out / "results.md").read_text()
    assert "| TraPO |" in md and "| Unsupervised TTRL, all questions |" in md
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"supervised", "unsupervised", "trapo", "trapo_random"}
    assert "3_unsupervised_degrades" in results["claims"]
    # rerunning reuses the finished runs, but not under another budget
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stderr.count("reusing") == 4
    other = subprocess.run(
        [*cmd[:5], "2", *cmd[6:], "--methods", "supervised"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert other.returncode == 0 and "ran 5 steps, not 2: running again" in other.stderr, other.stderr[-2000:]
