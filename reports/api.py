"""The entry points ``build`` and ``diff``: read inputs, call the pure tables, write outputs.

Inputs are results files (JSON Lines from ``harness.collect.collector``) or report directories (their
``results.csv``, plus the unreadable lines their ``summary.json`` recorded), so a diff can compare
last night's report directory with today's raw results. Next to an input, a ``nightly.json`` and a
``not_run.txt`` say what the run left out (``reports.scope``) when that nightly made the input (the same
selection id, ``harness.run.stored_selection``); a report built from results files also
gets one page per case that did not pass (``reports.case_page``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.cases.records import CaseRecord, NotRun, parse_not_run
from harness.collect.collector import BadLine, PathLike, read_records, record_full_id
from harness.run.stored_selection import SELECTION_SUFFIX, read_selection, selection_path
from reports import render, render_html, render_md
from reports.attribution import attribute, attributions_dict
from reports.case_page import CASES_DIR, write_case_pages
from reports.diff import RATIO_FACTOR, RATIO_FLOOR, DiffResult, diff_frames
from reports.grid import build_grid
from reports.matrix import (
    Summary, frame_from_csv, latest, marginals, parity_matrices, records_frame, sort_failing, summarize, unexpected_passes,
)
from reports.scope import PartInput, RunScope, merge_scopes, not_run_frame, part_problems, scope_from_nightly

CSV_NAME = "results.csv"
SUMMARY_NAME = "summary.json"
MARKDOWN_NAME = "matrix.md"
HTML_NAME = "matrix.html"
NIGHTLY_NAME = "nightly.json"
NOT_RUN_NAME = "not_run.txt"
#: diffs the report links to when they sit in its directory.
DIFF_NAMES = ("diff.html", "diff.md")


@dataclass
class Loaded:
    """Inputs read into one frame, one row per case."""

    frame: pd.DataFrame
    bad_lines: list[BadLine]
    #: older records of a case replaced by a newer one.
    superseded: int
    inputs: list[str]
    #: the full record of each case of ``frame`` read from a results file (none from ``results.csv``).
    records: dict[str, CaseRecord] = field(default_factory=dict)
    #: what the inputs' runs left out, from ``nightly.json``/``not_run.txt`` beside them; None if whole.
    scope: RunScope | None = None


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh sibling directory of ``out`` to write a report into. When the block ends, each of its
    entries takes the place of the one of the same name in ``out`` (``out`` itself when it did not
    exist): a file by ``os.replace``, a directory (``cases/``) by moving the old one aside first. When
    the block raises (a full or read-only disk, Ctrl-C), ``out`` is left as it was. The staging directory
    is removed either way; a ``kill -9`` leaves it as a hidden ``.NAME.*.tmp`` beside ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        report = tmp / "report"
        report.mkdir()
        yield report
        if not out.exists():
            os.rename(report, out)
            return
        for entry in sorted(report.iterdir()):
            target = out / entry.name
            if entry.is_dir() and target.is_dir():
                os.rename(target, tmp / f"old-{entry.name}")
            os.replace(entry, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def selection_ids(path: Path) -> set[str]:
    """The ids of the selections ``path`` holds results of (``harness.run.stored_selection``): a results
    file's own, or those of the results files in a directory."""
    # A merged night's selection is its parts' (``shards/K-of-N``: the directory keeps its earlier name; every
    # part shares the selection's id).
    files = (sorted([*path.glob("*" + SELECTION_SUFFIX), *path.glob("shards/*/*" + SELECTION_SUFFIX)]) if path.is_dir()
             else [selection_path(path)])
    found = (read_selection(f.with_name(f.name[: -len(SELECTION_SUFFIX)]), unreadable_ok=True) for f in files)
    return {s.id for s in found if s is not None}


def read_scope(directory: Path, ids: set[str] | None = None) -> RunScope | None:
    """The scope ``directory``'s ``nightly.json`` and ``not_run.txt`` describe, when that nightly made
    the results (its selection id is among ``ids``, default: those of ``directory``); else None. A
    nightly that once wrote into the same directory says nothing about unrelated results."""
    not_run_path, nightly_path = directory / NOT_RUN_NAME, directory / NIGHTLY_NAME
    state: dict = {}
    if nightly_path.exists():
        try:
            state = json.loads(nightly_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            state = {}
    night = (state.get("selection") or {}).get("id") if isinstance(state, dict) else None
    if night is None or night not in (selection_ids(directory) if ids is None else ids):
        return None
    not_run = parse_not_run(not_run_path.read_text(encoding="utf-8")) if not_run_path.exists() else []
    return scope_from_nightly(state, not_run)


def _load_one(path: Path) -> tuple[pd.DataFrame, list[BadLine], list[CaseRecord]]:
    if path.is_dir():
        csv = path / CSV_NAME
        if not csv.exists():
            raise FileNotFoundError(f"{path} is a directory without {CSV_NAME}; give a report directory or a results file")
        frame = frame_from_csv(pd.read_csv(csv))
        bad: list[BadLine] = []
        summary = path / SUMMARY_NAME
        if summary.exists():
            bad = [BadLine(**b) for b in json.loads(summary.read_text()).get("bad_lines", [])]
        return frame, bad, []
    if not path.exists():
        raise FileNotFoundError(f"results file {path} does not exist")
    records, bad = read_records(path)
    return records_frame(records, sources=[str(path)] * len(records)), bad, records


def load(paths: PathLike | Iterable[PathLike]) -> Loaded:
    """Read results files and/or report directories; a case recorded twice keeps its latest record."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not paths:
        raise ValueError("reports: give at least one results file or report directory")
    frames, bad_lines, records, parts = [], [], [], []
    scopes = []
    for path in paths:
        frame, bad, recs = _load_one(path)
        frames.append(frame)
        bad_lines += bad
        records += recs
        scopes.append(read_scope(path if path.is_dir() else path.parent, selection_ids(path)))
        stored = None if path.is_dir() else read_selection(path, unreadable_ok=True)
        if stored is not None and stored.part is not None:
            parts.append(PartInput(str(path), stored.part, stored.case_ids, frozenset(map(record_full_id, recs)),
                                   frozenset(n.full_id for n in scopes[-1].not_run) if scopes[-1] is not None else frozenset()))
    problems = part_problems(parts)  # refuses parts of different partitions (ValueError)
    frames = [f for f in frames if not f.empty]
    frame = pd.concat(frames, ignore_index=True) if frames else records_frame([])
    frame, superseded = latest(frame)
    # The same winner as ``latest``: the newest time, the later input on a tie.
    by_id = {record_full_id(r): r for r in sorted(records, key=lambda r: r.time)}
    scope = merge_scopes(scopes)
    if problems:  # the whole selection is what the parts were cut from, present or not
        base = scope or RunScope()
        scope = RunScope(len(parts[0].selection), base.not_run, base.not_selected,
                         ", ".join(filter(None, [base.source, "parts"])), base.parts + problems)
    return Loaded(frame, bad_lines, superseded, [str(p) for p in paths], by_id, scope)


def build(
    paths: PathLike | Iterable[PathLike], out_dir: PathLike, *, cases: Iterable[str] = (),
    not_run: Sequence[NotRun | tuple[str, str]] | None = None, selected: int | None = None, plot_deadline: float | None = None,
) -> Summary:
    """Write the report of ``paths`` into ``out_dir``: matrix.md, matrix.html, results.csv, one PNG
    heatmap per matrix, one page per case that did not pass or passed against its expected failure (and
    per full id in ``cases``) under ``cases/``, and summary.json. Returns the summary (also in summary.json).

    ``not_run`` (``harness.cases.records.NotRun``, or ``(full id, why)`` pairs: those count in the banner but,
    without their config, mark no grid cell) and ``selected`` describe a partial run; by default they
    come from a ``nightly.json``/``not_run.txt`` next to the inputs. No case page is plotted after
    ``plot_deadline`` (``time.monotonic()``), so a time budget holds the report too.
    """
    loaded = load(paths)
    out = Path(out_dir)
    with staged(out) as stage:
        summary, wanted, case_files = _write_report(loaded, out, stage, cases, not_run, selected, plot_deadline)
    # Heatmaps and case pages from an earlier build into the same directory would read as current.
    for stale in out.glob("heatmap_*.png"):
        if stale.name not in wanted:
            stale.unlink()
    for stale in (out / CASES_DIR).glob("*"):
        if stale.is_file() and f"{CASES_DIR}/{stale.name}" not in case_files:
            stale.unlink()
    return summary


def _write_report(loaded: Loaded, out: Path, stage: Path, cases: Iterable[str],
                  not_run: Sequence[NotRun | tuple[str, str]] | None, selected: int | None,
                  plot_deadline: float | None) -> tuple[Summary, set[str], set[str]]:
    """``build``'s files, written into ``stage`` for ``out``; the summary, the heatmaps and case pages."""
    frame = loaded.frame
    scope = loaded.scope
    if not_run is not None or selected is not None:
        scope = RunScope(selected, [NotRun(*n) for n in not_run or []], [], "arguments", loaded.scope.parts if loaded.scope else [])
    scope = scope if scope is not None and scope.partial else None
    banner = scope.banner() if scope is not None else ""
    matrices = parity_matrices(frame)
    margs = marginals(frame)
    attributions = attribute(frame)
    summary = summarize(
        frame, matrices, out_dir=str(out), inputs=loaded.inputs,
        superseded=loaded.superseded, bad_lines=loaded.bad_lines,
    )
    summary.attribution = attributions_dict(attributions)
    summary.scope = scope.to_dict() if scope is not None else None

    wanted = {m.heatmap for m in summary.matrices}
    for matrix, ms in zip(matrices, summary.matrices):
        render.heatmap(matrix, str(stage / ms.heatmap))

    asked = set(cases)
    unknown = asked - set(frame["full_id"]) if not frame.empty else asked
    if unknown:
        raise ValueError(f"--cases: {sorted(unknown)[:5]} not in the results; give full ids (engine:reference:case_id)")
    chosen = sort_failing(frame) if not frame.empty else frame
    # A case expected to fail that passed gets a page too: the report lists it, saying what was expected.
    chosen = pd.concat([chosen, unexpected_passes(frame)])
    if asked:
        chosen = pd.concat([chosen, frame[frame["full_id"].isin(asked) & (frame["verdict"] == "pass")]])
    chosen = chosen.drop_duplicates("full_id")
    page_rows = [row for _, row in chosen.iterrows()]
    case_files = write_case_pages(page_rows, loaded.records, stage, banner=banner, plot_deadline=plot_deadline)

    links = {"Markdown": MARKDOWN_NAME, "results.csv": CSV_NAME}
    links.update({name: name for name in DIFF_NAMES if (out / name).exists()})
    frame.to_csv(stage / CSV_NAME, index=False)
    grid = build_grid(frame, not_run_frame(scope))
    pages = {str(row["full_id"]) for row in page_rows}
    (stage / MARKDOWN_NAME).write_text(render_md.markdown(
        summary, matrices, margs, frame, attributions=attributions, banner=banner,
        links={"HTML report": HTML_NAME, **{k: v for k, v in links.items() if k != "Markdown"}}, pages=pages,
    ), encoding="utf-8")
    (stage / HTML_NAME).write_text(render_html.html_page(
        summary, matrices, margs, frame=frame, grid=grid, attributions=attributions, banner=banner, links=links,
    ), encoding="utf-8")
    summary.files = [MARKDOWN_NAME, HTML_NAME, CSV_NAME, *sorted(wanted), *case_files, SUMMARY_NAME]
    (stage / SUMMARY_NAME).write_text(json.dumps(summary.to_dict(), indent=2, allow_nan=False, default=_json_default) + "\n", encoding="utf-8")
    return summary, wanted, set(case_files)


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
        not_run={n.full_id for n in after.scope.not_run} if after.scope is not None else (),
    )
