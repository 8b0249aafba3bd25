"""`python -m trapo.commands.report RUN_DIR [--out DIR]`: the report's command line (see the package docstring)."""

import sys

from trapo.commands.report import main

sys.exit(main())
