"""The comparison grid: every engine over the same columns, so engines compare cell by cell; pure.

Sections are (reference, model); within a section every sharding strategy has one row per engine,
engines next to each other, and every section shares the columns of the whole report (precision x
backward prefetch), so a column means the same thing everywhere. A cell aggregates as a matrix cell
does ([Note: what a cell counts] in ``reports.matrix``) and adds what a matrix cannot show:

- ``absent``: no case of the cell is in the matrix (never generated);
- ``not_run``: its cases were selected but not run (a time budget, a pool that did not start);
- ``unsupported``: the engine refused every case of the cell.

A cell's expected failures (known engine bugs, ``reports.matrix.is_expected_failure``) do not make it
fail: beside passes it is a pass with ``+Nx``; where every case that ran failed as expected its state is
``expected``, a colour of its own (neither a pass nor new breakage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pandas as pd

from reports.matrix import CellStats, ordered

GridState = Literal["pass", "fail", "flaky", "error", "expected", "unsupported", "not_run", "absent"]
CELL_KEYS = ("sharding_strategy", "precision", "backward_prefetch")


@dataclass(frozen=True)
class GridCell:
    stats: CellStats = CellStats()
    #: selected cases of the cell that were not run.
    not_run: int = 0

    @property
    def state(self) -> GridState:
        status = self.stats.status
        if status in ("pass", "fail", "flaky", "error", "expected"):
            return status  # type: ignore[return-value]
        if self.not_run:
            return "not_run"
        if status == "unsupported":
            return "unsupported"
        return "absent"


@dataclass
class GridRow:
    reference: str
    model: str
    strategy: str
    engine: str
    cells: dict[tuple[str, str], GridCell]

    def states(self) -> set[str]:
        return {c.state for c in self.cells.values()}


@dataclass
class GridSection:
    reference: str
    model: str
    rows: list[GridRow]
    #: the cases of the section (rows of the ``latest`` frame), for the cell details.
    cases: pd.DataFrame = field(repr=False)

    @property
    def anchor(self) -> str:
        return "grid-" + "".join(ch if ch.isalnum() else "-" for ch in f"{self.reference}-{self.model}")

    @property
    def title(self) -> str:
        return f"vs {self.reference} · {self.model}"

    def cell_cases(self, row: GridRow, precision: str, prefetch: str) -> pd.DataFrame:
        c = self.cases
        return c[(c["engine"] == row.engine) & (c["sharding_strategy"] == row.strategy)
                 & (c["precision"] == precision) & (c["backward_prefetch"] == prefetch)]


@dataclass
class Grid:
    engines: list[str]
    models: list[str]
    precisions: list[str]
    prefetches: list[str]
    sections: list[GridSection]

    @property
    def columns(self) -> list[tuple[str, str]]:
        return [(p, b) for p in self.precisions for b in self.prefetches]


def build_grid(frame: pd.DataFrame, not_run: pd.DataFrame | None = None) -> Grid:
    """The grid of a ``latest`` frame; ``not_run`` (``reports.scope.not_run_frame``) marks cells not run."""
    not_run = not_run if not_run is not None else pd.DataFrame(columns=["engine", "reference", "model", *CELL_KEYS])
    both = pd.concat([frame[["engine", "reference", "model", *CELL_KEYS]], not_run[["engine", "reference", "model", *CELL_KEYS]]])
    if both.empty:
        return Grid([], [], [], [], [])
    engines = ordered("engine", both["engine"])
    precisions = ordered("precision", both["precision"])
    prefetches = ordered("backward_prefetch", both["backward_prefetch"])
    stats = {key: CellStats.of(g) for key, g in frame.groupby(["engine", "reference", "model", *CELL_KEYS], sort=False)}
    missed = not_run.groupby(["engine", "reference", "model", *CELL_KEYS], sort=False).size().to_dict() if len(not_run) else {}
    sections = []
    for reference in ordered("reference", both["reference"]):
        for model in ordered("model", both["model"]):
            here = both[(both["reference"] == reference) & (both["model"] == model)]
            if here.empty:
                continue
            rows = []
            for strategy in ordered("sharding_strategy", here["sharding_strategy"]):
                for engine in engines:
                    cells = {}
                    for p in precisions:
                        for b in prefetches:
                            key = (engine, reference, model, strategy, p, b)
                            cells[(p, b)] = GridCell(stats.get(key, CellStats()), int(missed.get(key, 0)))
                    rows.append(GridRow(reference, model, strategy, engine, cells))
            cases = frame[(frame["reference"] == reference) & (frame["model"] == model)]
            sections.append(GridSection(reference, model, rows, cases))
    return Grid(engines, ordered("model", both["model"]), precisions, prefetches, sections)
