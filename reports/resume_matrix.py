"""The checkpoint side of a report: pure tables over a ``latest`` frame (one row per case), no files.

- ``checkpoint_table``: the checkpoint column group, engines as rows and (checkpoint type, optimizer)
  as two-level columns, each cell ``passed/total`` of the cases that save there (``+Nx`` expected
  failures and ``+Nu`` unsupported counted apart, as in a matrix cell: ``reports.matrix.COUNT_LEGEND``).
- ``resume_matrices``: per state-dict type, saved-by x loaded-by (the diagonal is an engine resuming its
  own checkpoint, off it cross-engine resume); a cell where nothing ran but something was refused says
  ``unsupported`` with the first reason.
- ``markdown_lines`` / ``html_section``: both, ready to append to ``matrix.md`` and ``matrix.html``.
"""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from harness.cases.case import LOOP_SEGMENTS
from reports.matrix import COUNT_LEGEND, CellStats, ordered

__all__ = ["checkpoint_table", "html_section", "markdown_lines", "resume_matrices", "resume_suffix"]

#: how long an ``unsupported`` reason may be inside a cell.
REASON_CHARS = 90


def resume_suffix(row: Any) -> str:
    """`` · adamw · ckpt sharded → builtin`` for a case off the default optimizer or checkpoint, else ""
    (rows of results written before these axes have neither)."""
    get = row.get if hasattr(row, "get") else row.__getitem__
    parts = []
    optimizer = get("optimizer")
    checkpoint = get("checkpoint")
    if isinstance(optimizer, str) and optimizer and optimizer != "sgd":
        parts.append(optimizer)
    if isinstance(checkpoint, str) and checkpoint and checkpoint != "none":
        loader = get("resume_engine")
        parts.append(f"ckpt {checkpoint}" + (f" → {loader}" if isinstance(loader, str) and loader else ""))
    # The training-loop axes off their defaults, by their id segments (``clip_norm``, ``accum2_nosync`` ...).
    parts.extend(names[value] for axis, names in LOOP_SEGMENTS.items() if isinstance(value := get(axis), str) and value in names)
    return "".join(f" · {p}" for p in parts)


def _checkpointed(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty or "checkpoint" not in frame.columns:
        return frame.iloc[0:0]
    return frame[frame["checkpoint"].fillna("none") != "none"]


def _label(cases: pd.DataFrame) -> str:
    if cases.empty:
        return ""
    stats = CellStats.of(cases)
    if stats.status == "unsupported":
        reason = str(cases["reason"].iloc[0])
        short = reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
        return f"unsupported: {short}"
    return f"{stats.passed}/{stats.total}{stats.count_suffix}"


def checkpoint_table(frame: pd.DataFrame) -> pd.DataFrame | None:
    """Engines x (checkpoint type, optimizer) over every case (``none`` included); None when the frame
    has no checkpoint case."""
    if _checkpointed(frame).empty:
        return None
    engines = ordered("engine", frame["engine"])
    columns = [(c, o) for c in ordered("checkpoint", frame["checkpoint"]) for o in ordered("optimizer", frame["optimizer"])]
    data = [
        [_label(frame[(frame["engine"] == e) & (frame["checkpoint"] == c) & (frame["optimizer"] == o)]) for c, o in columns]
        for e in engines
    ]
    index = pd.Index(engines, name="engine")
    return pd.DataFrame(data, index=index, columns=pd.MultiIndex.from_tuples(columns, names=["checkpoint", "optimizer"]))


def resume_matrices(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per checkpoint type: saved-by (rows) x loaded-by (columns) over every engine seen saving or loading."""
    cases = _checkpointed(frame)
    if cases.empty:
        return {}
    loaders = cases["resume_engine"].fillna("").astype(str)
    cases = cases.assign(_loader=loaders.where(loaders != "", cases["engine"]))
    engines = ordered("engine", list(cases["engine"]) + list(cases["_loader"]))
    out: dict[str, pd.DataFrame] = {}
    for kind in ordered("checkpoint", cases["checkpoint"]):
        of_kind = cases[cases["checkpoint"] == kind]
        data = [[_label(of_kind[(of_kind["engine"] == s) & (of_kind["_loader"] == loader)]) for loader in engines]
                for s in engines]
        out[kind] = pd.DataFrame(data, index=pd.Index(engines, name="saved by"),
                                 columns=pd.Index(engines, name="loaded by"))
    return out


def markdown_lines(frame: pd.DataFrame) -> list[str]:
    """The checkpoint column group and the cross-engine resume matrices as Markdown lines ([] when the
    frame has no checkpoint case)."""
    from tabulate import tabulate

    table = checkpoint_table(frame)
    if table is None:
        return []
    lines = ["", "## Checkpoints: save half-way, resume, compare", "",
             f"Cells: passed/total; {COUNT_LEGEND}. Columns: checkpoint type, then optimizer."]
    headers = ["engine"] + [f"{c}<br>{o}" for c, o in table.columns]
    rows = [[engine, *row] for engine, row in zip(table.index, table.values.tolist())]
    lines += ["", tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)]
    for kind, matrix in resume_matrices(frame).items():
        lines += ["", f"### Resume matrix · {kind}: saved by (rows) x loaded by (columns)", ""]
        rows = [[saver, *row] for saver, row in zip(matrix.index, matrix.values.tolist())]
        lines.append(tabulate(rows, headers=["saved by \\ loaded by", *matrix.columns], tablefmt="github", disable_numparse=True))
    return lines


def _html_table(table: pd.DataFrame, corner: str) -> str:
    head = "".join(f"<th>{html.escape(str(c) if not isinstance(c, tuple) else ' · '.join(map(str, c)))}</th>" for c in table.columns)
    rows = "".join(
        f"<tr><th>{html.escape(str(i))}</th>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for i, row in zip(table.index, table.values.tolist())
    )
    return f'<table class="matrix"><tr><th>{html.escape(corner)}</th>{head}</tr>{rows}</table>'


def html_section(frame: pd.DataFrame) -> str:
    """The same tables as ``markdown_lines``, as HTML ("" when the frame has no checkpoint case)."""
    table = checkpoint_table(frame)
    if table is None:
        return ""
    parts = ["<h2>Checkpoints: save half-way, resume, compare</h2>", _html_table(table, "engine")]
    for kind, matrix in resume_matrices(frame).items():
        parts += [f"<h3>Resume matrix · {html.escape(kind)}: saved by (rows) x loaded by (columns)</h3>",
                  _html_table(matrix, "saved by \\ loaded by")]
    return "\n".join(parts)
