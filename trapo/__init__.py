"""TraPO: Trajectory-based Policy Optimization for semi-supervised RLVR.

Layers, each importing only those below it (docs/architecture.md; tests/test_layers.py checks it):
    trapo.commands   what a user runs: train, eval, prepare, doctor, report, reproduce (python -m trapo)
    trapo.training   the loop: the trainer's phases, the update, grading a round, metrics and loggers
    trapo.engine     what runs models on devices: the DeepSpeed policy, the vLLM engine, checkpoints
    trapo.algorithm  the paper's math: losses, pass rates and TCS selection, rewards, pass@k
    trapo.config, trapo.data, trapo.console, trapo.runtime, trapo.hub   the shared vocabulary, imported by all
"""

import sys as _sys

__version__ = "0.1.0"

# `python -m trapo.eval` and its siblings ran the commands when they lived flat in trapo/: say the new
# invocation in one line instead of "No module named trapo.eval". While `-m` locates a module (and
# imports its parent, this package), sys.argv[0] is "-m"; the module asked for is in sys.orig_argv.
_MOVED = ("eval", "prepare", "doctor", "report", "reproduce", "readme")
if _sys.argv[:1] == ["-m"]:
    _argv = getattr(_sys, "orig_argv", [])
    for _flag, _module in zip(_argv, _argv[1:]):
        if _flag == "-m" and _module.removeprefix("trapo.") in _MOVED and _module.startswith("trapo."):
            _sys.exit(f"python -m {_module} is now `python -m trapo {_module[6:]}` (same arguments)")
