"""TraPO training entry point.

    deepspeed trapo_train.py --config configs/<exp>.yaml [key=value ...]
    python trapo_train.py                      # the embedded CPU default

The training loop (DeepSpeed ZeRO-3 policy, colocated vLLM rollouts, pass-rate
gating) is not in this repository yet: the core library it is built on
(`trapo.loss`, `trapo.passrate`, `trapo.rewards`) is. Until the trainer lands
this entry point says so and exits with status 2 rather than pretend to train.
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML experiment config under configs/")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.parse_args(argv)
    print(
        "trapo_train: the training loop is not implemented yet; the core library is "
        "(trapo.loss, trapo.passrate, trapo.rewards). See README.md, 'Status'.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
