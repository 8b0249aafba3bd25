"""A vLLM that is installed but fails to import (a torch build it was not made for, a missing CUDA library):
train, eval and the doctor say so in one line carrying the import error's message and naming the way out
(rollout.backend=hf; eval: --backend hf): train and eval after their input checks and before the model
loads, the doctor in its rollout backend check.

The subprocesses import a `vllm` package earlier on PYTHONPATH than the installed one, whose import raises as
a broken install's does."""

import os
import subprocess
import sys
import types

import pytest
from toyrun import VLLM, overrides

from trapo import runtime
from trapo.config import ConfigError
from trapo.engine.rollout import require_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAUSE = "libcudart.so.13: cannot open shared object file: No such file or directory"


@pytest.fixture
def broken_vllm(tmp_path):
    """The environment of a subprocess whose `import vllm` raises ImportError(CAUSE)."""
    package = tmp_path / "broken-site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError({CAUSE!r})\n")
    env = runtime.subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(package.parent), env["PYTHONPATH"]])
    return env


def trapo(args, env):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def one_line(out) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr + out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "error, shown",
    [
        (ImportError(CAUSE), f"ImportError: {CAUSE}"),
        (OSError("libcuda.so.1: cannot open shared object file"), "OSError: libcuda.so.1: cannot open shared"),
        (RuntimeError("\nCUDA driver version is insufficient\nfor CUDA runtime"), "RuntimeError: CUDA driver version"),
    ],
)
def test_any_error_importing_the_engines_names_is_one_line_with_its_message(monkeypatch, error, shown):
    """Raised by the names the engine imports (vllm.LLM's modules load lazily), not only by `import vllm`."""
    fake = types.ModuleType("vllm")

    def fail(name):
        raise error

    fake.__getattr__ = fail
    monkeypatch.setitem(sys.modules, "vllm", fake)
    with pytest.raises(ConfigError) as caught:
        require_backend("vllm")
    message = str(caught.value)
    assert "\n" not in message and shown in message and "rollout.backend=hf" in message, message
    assert message.startswith("rollout.backend: vllm is installed but fails to import")
    assert caught.value.__cause__ is error  # the traceback the log gets
    require_backend("vllm", load=False)  # installed: the check before the output is captured passes
    require_backend("hf")  # the hf backend never imports vLLM


@pytest.mark.toy_run
def test_train_stops_in_one_line_before_the_model_loads(broken_vllm, toy_dir, tmp_path):
    args = overrides(toy_dir, tmp_path, run_name="broken", max_steps=1, **VLLM)
    out = trapo(["trapo_train.py", *args], broken_vllm)
    line = one_line(out)  # no start-up line before it: the policy and the engine never started
    assert out.returncode == 2 and CAUSE in line and "rollout.backend=hf" in line, line
    log = (tmp_path / "broken" / "log.txt").read_text()
    assert "Traceback" in log and f"ImportError: {CAUSE}" in log  # where the import failed, for a bug report
    assert not (tmp_path / "broken" / "checkpoints").exists() and not (tmp_path / "broken" / "metrics.jsonl").exists()


@pytest.mark.toy_run
def test_eval_stops_in_one_line_naming_backend_hf_before_the_model_loads(broken_vllm, toy_dir, tmp_path):
    model, test = os.path.join(toy_dir, "seed-0", "model"), os.path.join(toy_dir, "seed-0", "test.jsonl")
    args = ["-m", "trapo", "eval", "--model", model, "--benchmarks", test, "--max-tokens", "12", "--out", str(tmp_path)]
    out = trapo(args, broken_vllm)
    line = one_line(out)
    assert out.returncode == 2 and CAUSE in line and "--backend hf" in line, line
    log = (tmp_path / "log.txt").read_text()
    assert "Traceback" in log and f"ImportError: {CAUSE}" in log


@pytest.mark.toy_run
def test_the_doctors_backend_check_fails_with_that_line(broken_vllm, tmp_path):
    """The doctor's table: the rollout backend check fails with the line; its trial run stops at the same check."""
    toy = [f"toy.dir={tmp_path / 'toy'}", "toy.sft_steps=1", "toy.labeled=8", "toy.unlabeled=8", "toy.test=8"]
    out = trapo(["-m", "trapo", "doctor", *toy], broken_vllm)  # a small toy: the trial run builds it first
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("rollout backend"))
    assert " FAIL " in row and CAUSE in row and "rollout.backend=hf" in row, row
    trial = next(line for line in out.stdout.splitlines() if line.startswith("trial run"))
    assert " FAIL " in trial and "fails to import" in trial, trial
