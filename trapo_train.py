"""TraPO training: the launcher's script.

    deepspeed trapo_train.py --config configs/<exp>.yaml [dotted.key=value ...]
    python trapo_train.py                      # the embedded CPU default (configs/toy.yaml)

The same as `python -m trapo train` (trapo/commands/train.py), as a file the `deepspeed` launcher can run.
"""

from trapo import console
from trapo.commands.train import main

if __name__ == "__main__":
    console.exit_now(main())  # a finished run: no interpreter teardown
