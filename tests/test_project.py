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
