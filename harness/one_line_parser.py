"""The argument parser of every command line (``python -m harness``, ``python -m reports``): an error is
one line naming the option, exit status 2; the usage is what ``--help`` is for."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse's own print the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help for usage)\n")
