"""The argument parser of every command line (``python -m harness``, ``python -m reports``): an error is
one line naming the option, exit status 2; the usage is what ``--help`` is for. The value types both
front ends share live here too (they import nothing: ``reports`` runs without torch)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

__all__ = ["OneLineParser", "non_empty", "non_empty_path"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse's own print the whole usage first), and
    whose ``--help`` shows no backticks: the descriptions are module docstrings, whose ````code````
    marks are for the source, not the terminal."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help for usage)\n")

    def format_help(self) -> str:
        return super().format_help().replace("`", "")


def non_empty(text: str) -> str:
    """An option value that must not be blank (an empty ``--filter ""`` would match every case)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}")
    return text


def non_empty_path(text: str) -> Path:
    """A path option that must not be blank (``--out ""`` must not silently mean the default path or ``.``)."""
    return Path(non_empty(text))
