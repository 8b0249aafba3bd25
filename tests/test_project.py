"""Project wiring: the entry point and the shipped DeepSpeed config."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deepspeed_config_is_valid_zero3():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with open(os.path.join(ROOT, "configs", "deepspeed_zero3.json")) as f:
        cfg = json.load(f)
    assert DeepSpeedZeroConfig(**cfg["zero_optimization"]).stage == 3


def test_entry_point_help_names_the_launch_command():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trapo_train.py"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "deepspeed trapo_train.py --config configs/<exp>.yaml" in out.stdout


def test_public_names_import():
    from trapo.loss import group_advantages, policy_loss  # noqa: F401
    from trapo.passrate import PassRateTracker, reliable_mask, tcs  # noqa: F401
    from trapo.rewards import majority_vote, math_reward, self_certainty_reward  # noqa: F401


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
    assert "trapo/eval.py" in runnable and "Makefile" in runnable
    offenders = []
    for rel in runnable:
        depth = rel.count("/")  # parents[depth] of a file is the repository root
        with open(os.path.join(ROOT, rel), errors="replace") as f:
            for n, line in enumerate(f, 1):
                for m in outside.finditer(line):
                    if m.group(1) is None or int(m.group(1)) > depth:
                        offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)
