"""Parity reports: results files -> parity matrices (md, html, csv, png, summary.json) and diffs.

``reports.build(paths, out_dir) -> Summary`` and ``reports.diff(old, new) -> DiffResult`` are the
entry points; ``python -m reports build|diff`` is their CLI.

Note: ``reports.diff`` is the function. The module of the same name is reached with
``from reports.diff import ...`` (``import reports.diff as m`` would give the function).
"""

from reports.api import build, diff, load
from reports.diff import Change, DiffResult
from reports.matrix import Summary

__all__ = ["build", "diff", "load", "Summary", "DiffResult", "Change"]
