"""Command-line options shared by the front ends: the case selection (``harness.runner.Selection``)."""

from __future__ import annotations

import argparse

__all__ = ["add_selection", "csv_list"]


def csv_list(text: str) -> list[str]:
    """A comma-separated option value as a list, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def add_selection(p: argparse.ArgumentParser) -> None:
    """The options ``harness.runner.Selection.from_args`` reads, plus ``--world-size``."""
    p.add_argument("--matrix", default="smoke", choices=("smoke", "pairwise", "full"), help="case generator (harness.matrix)")
    p.add_argument("--engines", type=csv_list, default=None, help="comma list: builtin,torch-fsdp,torch-fsdp2 (default: all)")
    p.add_argument("--references", type=csv_list, default=None, help="comma list: ddp,local (default: the matrix's)")
    p.add_argument("--models", type=csv_list, default=None, help="comma list of harness.models.MODELS (default: the matrix's)")
    p.add_argument("--world-size", type=lambda s: [int(x) for x in csv_list(s)], default=None,
                   help="ranks per case, comma list for several pools (default 2; under torchrun its WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=None, help="training steps per case (default: CaseConfig's 5)")
    p.add_argument("--check-determinism", action="store_true", help="run each engine twice and require bitwise-equal results")
    p.add_argument("--filter", action="append", default=[], help="keep cases whose full id contains this (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="run at most this many cases")
