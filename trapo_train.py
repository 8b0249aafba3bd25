"""TraPO training: the launcher's script.

    deepspeed trapo_train.py --config configs/<exp>.yaml [dotted.key=value ...]
    python trapo_train.py                      # the embedded CPU default (configs/toy.yaml)

The same as `python -m trapo train` (trapo/commands/train.py), as a file the `deepspeed` launcher can run.
"""

import sys

from trapo import console
from trapo.commands import fork_server
from trapo.commands.train import main

if __name__ == "__main__":
    # on CPU, a rank launched under a caller that runs a fork server (the tests, the GPU check's dry run) hands its
    # run to a child forked there and stands in for it; None: the run is here
    forwarded = fork_server.forward(sys.argv)
    console.exit_now(main() if forwarded is None else forwarded)  # a finished run: no interpreter teardown
