"""``python -m harness history DIR... --out DIR``: the trend page over several nightlies.

The page itself is ``reports.history``'s (verdicts and worst ratio per engine per night, when each
failing case first failed, fixes and regressions with their nights, performance ratios); this front
end only gives it the harness's command name, next to ``run`` and ``nightly``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.one_line_parser import non_empty_path

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", type=Path, help="nightly (or run) directories, ordered by name")
    p.add_argument("--out", required=True, type=non_empty_path, help="directory to write history.md/.html/.json and plots into")


def main(args: argparse.Namespace) -> int:
    from reports.__main__ import main as reports_main

    return reports_main(["history", *map(str, args.dirs), "--out", str(args.out)])
