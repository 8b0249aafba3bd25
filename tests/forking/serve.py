"""The tests' pre-imported parent (servers.py): the grader parent's seam put in place (graders.py), so that the
Math-Verify supervisors of every forked trainer fork from the test session's grader parent, then the study
runner's parent loop (trapo/commands/reproduce/forking.py).

    python -u tests/forking/serve.py FD
"""

import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `forking`

from forking import graders  # noqa: E402

from trapo.commands.reproduce.forking import serve  # noqa: E402

graders.install()
serve(int(sys.argv[1]))
