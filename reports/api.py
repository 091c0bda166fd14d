"""The two entry points, ``build`` and ``diff``: read inputs, call the pure tables, write outputs.

Inputs are results files (JSON Lines from ``harness.collector``) or report directories (their
``results.csv``, plus the unreadable lines their ``summary.json`` recorded), so a diff can compare
last night's report directory with today's raw results.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.collector import BadLine, PathLike, read_records
from reports import render
from reports.diff import RATIO_FACTOR, RATIO_FLOOR, DiffResult, diff_frames
from reports.matrix import Summary, frame_from_csv, latest, marginals, parity_matrices, records_frame, summarize

CSV_NAME = "results.csv"
SUMMARY_NAME = "summary.json"
MARKDOWN_NAME = "matrix.md"
HTML_NAME = "matrix.html"


@dataclass
class Loaded:
    """Inputs read into one frame, one row per case."""

    frame: pd.DataFrame
    bad_lines: list[BadLine]
    #: older records of a case replaced by a newer one.
    superseded: int
    inputs: list[str]


def _load_one(path: Path) -> tuple[pd.DataFrame, list[BadLine]]:
    if path.is_dir():
        csv = path / CSV_NAME
        if not csv.exists():
            raise FileNotFoundError(f"{path} is a directory without {CSV_NAME}; give a report directory or a results file")
        frame = frame_from_csv(pd.read_csv(csv))
        bad: list[BadLine] = []
        summary = path / SUMMARY_NAME
        if summary.exists():
            bad = [BadLine(**b) for b in json.loads(summary.read_text()).get("bad_lines", [])]
        return frame, bad
    if not path.exists():
        raise FileNotFoundError(f"results file {path} does not exist")
    records, bad = read_records(path)
    return records_frame(records, sources=[str(path)] * len(records)), bad


def load(paths: PathLike | Iterable[PathLike]) -> Loaded:
    """Read results files and/or report directories; a case recorded twice keeps its latest record."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not paths:
        raise ValueError("reports: give at least one results file or report directory")
    frames, bad_lines = [], []
    for path in paths:
        frame, bad = _load_one(path)
        frames.append(frame)
        bad_lines += bad
    frames = [f for f in frames if not f.empty]
    frame = pd.concat(frames, ignore_index=True) if frames else records_frame([])
    frame, superseded = latest(frame)
    return Loaded(frame, bad_lines, superseded, [str(p) for p in paths])


def build(paths: PathLike | Iterable[PathLike], out_dir: PathLike) -> Summary:
    """Write the report of ``paths`` into ``out_dir``: matrix.md, matrix.html, results.csv, one PNG
    heatmap per matrix and summary.json. Returns the summary (also in summary.json)."""
    loaded = load(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = loaded.frame
    matrices = parity_matrices(frame)
    margs = marginals(frame)
    summary = summarize(
        frame, matrices, out_dir=str(out), inputs=loaded.inputs,
        superseded=loaded.superseded, bad_lines=loaded.bad_lines,
    )

    # Heatmaps of matrices from an earlier build into the same directory would read as current.
    wanted = {m.heatmap for m in summary.matrices}
    for stale in out.glob("heatmap_*.png"):
        if stale.name not in wanted:
            stale.unlink()
    for matrix, ms in zip(matrices, summary.matrices):
        render.heatmap(matrix, str(out / ms.heatmap))
    frame.to_csv(out / CSV_NAME, index=False)
    (out / MARKDOWN_NAME).write_text(render.markdown(summary, matrices, margs, frame), encoding="utf-8")
    (out / HTML_NAME).write_text(render.html_page(summary, matrices, margs, frame), encoding="utf-8")
    summary.files = [MARKDOWN_NAME, HTML_NAME, CSV_NAME, *sorted(wanted), SUMMARY_NAME]
    (out / SUMMARY_NAME).write_text(json.dumps(summary.to_dict(), indent=2, allow_nan=False, default=_json_default) + "\n", encoding="utf-8")
    return summary


def _json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars from pandas
        return value.item()  # type: ignore[no-any-return]
    raise TypeError(f"summary.json: cannot write {type(value).__name__} {value!r}")


def diff(
    old: PathLike | Sequence[PathLike], new: PathLike | Sequence[PathLike], *,
    ratio_factor: float = RATIO_FACTOR, ratio_floor: float = RATIO_FLOOR,
) -> DiffResult:
    """Compare two results (files or report directories), case by case; see ``reports.diff``."""
    before, after = load(old), load(new)
    return diff_frames(
        before.frame, after.frame, ratio_factor=ratio_factor, ratio_floor=ratio_floor,
        bad_lines=before.bad_lines + after.bad_lines,
    )
