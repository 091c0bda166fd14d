"""``python -m harness ...``; see ``harness.cli``."""

import sys

from harness.cli import main

# Spawned rank processes import this module as ``__mp_main__``: only the real main runs the CLI.
if __name__ == "__main__":
    sys.exit(main())
