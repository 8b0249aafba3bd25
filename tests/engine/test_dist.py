"""Distributed helpers that need no second process."""

import subprocess
import sys

from trapo import runtime

PROBE = """
import sys
from trapo.engine import dist
deepspeed = dist.import_deepspeed()
from deepspeed.autotuning import autotuner
print("mlflow" in sys.modules, autotuner.has_mlflow, dist.import_deepspeed() is deepspeed)
import mlflow  # still importable for logging.mlflow
print(mlflow.__name__)
"""


def test_deepspeed_imports_without_mlflow_which_stays_importable():
    out = subprocess.run([sys.executable, "-c", PROBE], env=runtime.subprocess_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["False False True", "mlflow"]  # (DeepSpeed prints its accelerator first)
