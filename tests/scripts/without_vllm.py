"""`trapo_train.py` in a process where vLLM cannot be imported (as on a machine without it):
python tests/scripts/without_vllm.py key=value ...   (the trainer's own arguments)."""

import os
import sys

sys.modules["vllm"] = None  # any `import vllm` now raises ImportError
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trapo import console  # noqa: E402
from trapo.commands.train import main  # noqa: E402

if __name__ == "__main__":
    console.exit_now(main(sys.argv[1:]))
