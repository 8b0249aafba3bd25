"""Project wiring: the entry point and the shipped DeepSpeed config."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deepspeed_config_is_valid_zero3():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with open(os.path.join(ROOT, "configs", "deepspeed_zero3.json")) as f:
        cfg = json.load(f)
    assert DeepSpeedZeroConfig(**cfg["zero_optimization"]).stage == 3
    with open(os.path.join(ROOT, "configs", "deepspeed_zero2.json")) as f:  # LoRA on one GPU: the base whole
        zero2 = json.load(f)
    assert DeepSpeedZeroConfig(**zero2["zero_optimization"]).stage == 2
    assert {k: v for k, v in zero2.items() if k != "zero_optimization"} == {
        k: v for k, v in cfg.items() if k != "zero_optimization"
    }  # the same precision and clipping


def test_entry_point_help_names_the_launch_command():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trapo_train.py"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "deepspeed trapo_train.py --config configs/<exp>.yaml" in out.stdout


def _python(*args):
    from trapo import runtime

    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=runtime.subprocess_env(), capture_output=True, text=True
    )


def test_one_entry_point_lists_every_command_and_dispatches():
    out = _python("-m", "trapo", "--help")
    assert out.returncode == 0
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert listed == [
        "train",
        "eval",
        "configs",
        "prepare",
        "get-model",
        "word-problems",
        "doctor",
        "report",
        "reproduce",
        "gpu-kit",
        "gpu-check",
        "gpu-bench",
    ]
    assert "readme" not in out.stdout  # a maintainer's tool: it runs (below), unlisted
    # `deepspeed --module trapo doctor ...` runs `python -m trapo --local_rank=N doctor ...`
    out = _python("-m", "trapo", "--local_rank=0", "doctor", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m trapo doctor")
    out = _python("-m", "trapo", "train", "--help")
    assert out.returncode == 0 and "deepspeed trapo_train.py --config configs/<exp>.yaml" in out.stdout
    assert out.stdout.startswith("usage: python -m trapo train")
    for name in ("eval", "reproduce", "readme"):  # their parsers take argparse's default prog
        assert _python("-m", "trapo", name, "--help").stdout.startswith(f"usage: python -m trapo {name}"), name
    assert _python("trapo_train.py", "--help").stdout.startswith("usage: trapo_train.py")
    out = _python("-m", "trapo", "evaluate")
    assert out.returncode == 2 and "unknown command 'evaluate'" in out.stderr


def test_old_module_invocations_name_the_new_command():
    for name in ("eval", "prepare", "doctor", "report", "reproduce", "readme"):
        out = _python("-m", f"trapo.{name}", "--help")
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr == f"python -m trapo.{name} is now `python -m trapo {name}` (same arguments)\n"
    assert _python("-m", "trapo.commands.report", "--help").returncode == 0  # the modules themselves still run


def test_public_names_import():
    from trapo.algorithm.loss import group_advantages, policy_loss  # noqa: F401
    from trapo.algorithm.passrate import PassRateTracker, reliable_mask, tcs  # noqa: F401
    from trapo.algorithm.rewards import majority_vote, math_reward, self_certainty_reward  # noqa: F401


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_no_code_path_reaches_outside_the_repository():
    """The evaluation sets ship in data/benchmarks; nothing the project runs may read a folder beside it."""
    import re

    from trapo.data import REPO_BENCHMARKS, benchmarks_dir

    assert os.path.commonpath([ROOT, str(REPO_BENCHMARKS)]) == ROOT
    assert (REPO_BENCHMARKS / "math.parquet").is_file()
    if not os.environ.get("TRAPO_BENCHMARKS"):
        assert benchmarks_dir() == REPO_BENCHMARKS
    # A parent of the repository, spelled any of the ways our code builds paths.
    outside = re.compile(r"""\.\./shared|["']shared["']|parents\[(\d+)\]|["']\.\.["']\s*,\s*["']\.\.["']""")
    runnable = [
        f
        for f in _tracked_files()
        if f.endswith((".py", ".yaml", ".json", ".toml", ".txt")) or f in ("Makefile", ".ci/run")
    ]
    assert "trapo/commands/eval.py" in runnable and "Makefile" in runnable
    offenders = []
    for rel in runnable:
        depth = rel.count("/")  # parents[depth] of a file is the repository root
        with open(os.path.join(ROOT, rel), errors="replace") as f:
            for n, line in enumerate(f, 1):
                for m in outside.finditer(line):
                    if m.group(1) is None or int(m.group(1)) > depth:
                        offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_torchdynamo_disable_is_unset_on_gpu_and_kept_on_cpu(monkeypatch):
    """A TORCHDYNAMO_DISABLE inherited from a CPU shell would turn vLLM's compiled model off on GPU."""
    from trapo import runtime

    monkeypatch.setattr(runtime, "NOTICES", [])
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    runtime.configure(gpu=True)
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    assert "unset on GPU" in runtime.NOTICES[0]
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    runtime.configure(gpu=False)
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1" and len(runtime.NOTICES) == 1


def test_update_threads_hold_for_the_update_and_are_restored_where_vllm_disabled_set_num_threads(monkeypatch):
    """train.update_threads (runtime.intra_op_threads): vLLM's CPU worker replaces torch.set_num_threads with a
    no-op in its process; the update's threads are still set for the block and the rollout's restored after,
    also when the block raises. A bad value is a config error naming the key."""
    import torch

    from trapo import runtime
    from trapo.config import ConfigError, load_config

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # as vLLM's CPU worker leaves it
    with runtime.intra_op_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), runtime.intra_op_threads(before + 1):
        raise RuntimeError("the update failed")
    assert torch.get_num_threads() == before
    with runtime.intra_op_threads(None):
        assert torch.get_num_threads() == before
    with pytest.raises(ConfigError, match="train.update_threads"):
        load_config(None, ["train.update_threads=0"])


def test_trapo_device_overrides_the_gpu_probe(monkeypatch):
    """TRAPO_DEVICE (docs/configuration.md): `cpu` on a node with GPUs gets the CPU settings, `cuda` where the probe
    finds no device node the GPU's; unset, the device nodes decide."""
    import types

    from trapo import runtime

    monkeypatch.delenv("TRAPO_DEVICE", raising=False)
    monkeypatch.setattr(runtime, "glob", types.SimpleNamespace(glob=lambda pattern: ["/dev/nvidia0"]))
    assert runtime.has_gpu() and "OMP_NUM_THREADS" not in runtime.settings()
    monkeypatch.setenv("TRAPO_DEVICE", "cpu")
    assert not runtime.has_gpu() and runtime.settings()["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(runtime, "glob", types.SimpleNamespace(glob=lambda pattern: []))
    monkeypatch.delenv("TRAPO_DEVICE")
    assert not runtime.has_gpu() and runtime.settings()["TORCHDYNAMO_DISABLE"] == "1"
    monkeypatch.setenv("TRAPO_DEVICE", "cuda")
    assert runtime.has_gpu() and "TORCHDYNAMO_DISABLE" not in runtime.settings()


HANG = """
import os, sys, time
from trapo import runtime
runtime.configure()
from trapo.engine import dist
rank = int(os.environ["RANK"])
dist.init_distributed(timeout_minutes=0.05)  # 3 s
if rank == 1:
    time.sleep(25)  # a rank that hangs
    sys.exit(0)
start = time.time()
try:
    dist.all_max(1)
except Exception as err:
    print(dist.timeout_message(err, 0.05), round(time.time() - start, 1))
"""


def test_a_hung_rank_stops_the_others_after_dist_timeout_minutes(tmp_path):
    import socket
    import time

    from trapo import runtime

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = runtime.subprocess_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", HANG],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    start = time.time()
    out, err = procs[0].communicate(timeout=120)
    procs[1].kill()
    assert "a collective waited longer than dist_timeout_minutes=0.05" in out, out + err[-2000:]
    assert time.time() - start < 60  # not torch's default 30 minutes


def test_installed_console_script_is_python_m_trapo(tmp_path):
    """`make setup` installs the project (editable, no dependencies): `trapo` runs from any directory."""
    script = os.path.join(os.path.dirname(sys.executable), "trapo")
    assert os.path.isfile(script), "no .venv/bin/trapo: run `make setup` (it installs the project with -e .)"
    out = subprocess.run([script, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: trapo <command>")
    assert [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")] == [
        line.split()[0] for line in _python("-m", "trapo", "--help").stdout.splitlines() if line.startswith("  ")
    ]
    out = subprocess.run([script, "eval", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.startswith("usage: trapo eval")
    out = subprocess.run([script, "nosuch"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 2 and "trapo: unknown command 'nosuch'" in out.stderr


def test_declared_dependency_ranges_hold_the_tested_pins():
    """pyproject.toml's ranges (pip install -e . into an existing environment) contain requirements*.txt's pins."""
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = {}
    for name in ("requirements.txt", "requirements-cpu.txt", "requirements-dev.txt"):
        with open(os.path.join(ROOT, name)) as f:
            for line in f:
                line = line.split("#")[0].strip()
                if "==" in line:
                    package, version = line.split("==")
                    pins[package.strip().lower()] = version.strip()
    checked = 0
    for req in declared:
        pin = pins.get(req.name.lower())
        if pin is not None:
            assert req.specifier.contains(pin), f"pyproject.toml: {req} does not hold the pin {req.name}=={pin}"
            checked += 1
    assert checked >= 15  # every runtime package, vLLM's two builds, the trackers and the dev tools
    assert project["scripts"]["trapo"] == "trapo.__main__:cli"
