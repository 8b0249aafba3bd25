"""`python -m trapo.commands.reproduce [--quick] ...`: the reproduction's command line (see the package docstring)."""

import sys

from trapo.commands.reproduce import main

sys.exit(main())
