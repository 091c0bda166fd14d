"""Comparing two sets of results case by case: pure, over two ``latest`` frames.

Order of the result (and of the printed diff): regressions first, worst first (crashes, timeouts,
pass -> fail/error, lost support, error ratio grown), then fixes, then cells and cases that are new,
then removed cases, then other verdict changes. Any regression makes the CLI exit non-zero.

[Note: what counts as a regression]
- a case that passed now fails or errors, or is now ``unsupported`` (coverage silently lost);
- a case now times out or crashes that did not before, including a case that is new: a hang or crash
  takes the whole run down, whatever the case;
- a case's worst error relative to tolerance grew more than ``ratio_factor`` times and is now at least
  ``ratio_floor`` (tiny errors double by noise; 0 -> 0.3 is real drift).
A new case that merely fails is listed as new, not as a regression: adding a case that exposes a known
gap must not block the change that adds it. It is still counted in the headline (``new_failing``), which
is never green over one.

[Note: expected failures]
A case whose new record is an expected failure (``reports.matrix.is_expected_failure``: a known engine
bug its suite holds as a strict expectation) is never a regression nor a new failing case: whatever it
was before, its change is ``changed`` (``new`` for a new case) and says ``expected``. An expected failure
that now passes is a ``fix`` that says so: the bug went away, and its expectation should go too.

[Note: not run is not removed]
A case of the old results that the new run selected but did not run (a time budget spent, a pool that
did not start: ``not_run``) is ``not run``, not ``removed``. Two results with no case in common are
refused: nothing in one says anything about the other.

[Note: flaky cases]
A repeated case whose runs disagree is ``flaky`` (``harness.run.repeats``). ``pass -> flaky`` is a
regression: the case now fails in some runs, a race that appeared or that the run newly exposes.
``flaky -> pass`` is only ``changed``, not a fix: a race that showed in some runs can pass any one run,
so one clean result proves nothing. ``fail -> flaky`` and back are ``changed`` too.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pandas as pd

from harness.cases.records import ABORTED, ERRORED, FAILING, SEVERITY
from harness.collect.collector import BadLine
from reports.matrix import fmt_ratio, is_expected_row
from reports.resume_matrix import resume_suffix

ChangeKind = Literal["regression", "fix", "new", "not_run", "removed", "changed"]
KIND_ORDER: dict[str, int] = {"regression": 0, "fix": 1, "new": 2, "not_run": 3, "removed": 4, "changed": 5}
#: verdicts of a new case that the headline counts as failing (timeouts and crashes are regressions).
NEW_FAILING = tuple(v for v in FAILING if v not in ABORTED)

#: default: a worst ratio must more than double to count ...
RATIO_FACTOR = 2.0
#: ... and end at least this close to the tolerance.
RATIO_FLOOR = 0.05

_CELL_AXES = ("engine", "reference", "model", "sharding_strategy", "precision", "backward_prefetch")


def cell_name(row: pd.Series | dict[str, Any]) -> str:
    """``torch-fsdp vs ddp · nested · full_shard · bf16 · bwd pre``: the matrix cell of a case; a case off
    the default optimizer or checkpoint adds them (``· adamw · ckpt sharded → builtin``)."""
    name = (f"{row['engine']} vs {row['reference']} · {row['model']} · {row['sharding_strategy']} · "
            f"{row['precision']} · bwd {row['backward_prefetch']}")
    return name + resume_suffix(row)


def _ratio(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


@dataclass
class Change:
    """One case whose outcome differs between the old and the new results."""

    kind: ChangeKind
    #: what changed, e.g. ``pass → fail``, ``new timeout``, ``ratio ×3.2``.
    what: str
    full_id: str
    cell: str
    old_verdict: str | None
    new_verdict: str | None
    old_ratio: float | None
    new_ratio: float | None
    #: the newer record's reason (the older one's for removed cases).
    reason: str = ""
    #: sort key within its kind (smaller first); see the module note.
    rank: tuple = field(default=(), repr=False)
    #: the new record is an expected failure (see [Note: expected failures]).
    expected: bool = False


@dataclass
class DiffResult:
    changes: list[Change]
    #: matrix cells present only in the new results, in display order.
    new_cells: list[str]
    #: unreadable lines of either input (a cut record is missing from the comparison).
    bad_lines: list[BadLine] = field(default_factory=list)
    old_cases: int = 0
    new_cases: int = 0

    def of_kind(self, kind: ChangeKind) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]

    @property
    def regressions(self) -> list[Change]:
        return self.of_kind("regression")

    @property
    def new_failing(self) -> list[Change]:
        """New cases that do not pass: they do not block (see the module note), but are never hidden."""
        return [c for c in self.of_kind("new") if c.new_verdict in NEW_FAILING and not c.expected]

    @property
    def exit_code(self) -> int:
        """1 when anything regressed, else 0."""
        return 1 if self.regressions else 0

    def to_dict(self) -> dict[str, Any]:
        def clean(change: Change) -> dict[str, Any]:
            d = asdict(change)
            d.pop("rank")
            for key in ("old_ratio", "new_ratio"):
                if d[key] is not None and not math.isfinite(d[key]):
                    d[key] = str(d[key])
            return d

        return {
            "exit_code": self.exit_code,
            "counts": {k: len(self.of_kind(k)) for k in KIND_ORDER},  # type: ignore[arg-type]
            "new_failing": len(self.new_failing),
            "old_cases": self.old_cases,
            "new_cases": self.new_cases,
            "changes": [clean(c) for c in self.changes],
            "new_cells": self.new_cells,
            "bad_lines": [b.to_dict() for b in self.bad_lines],
        }


def _classify(old: pd.Series, new: pd.Series, ratio_factor: float, ratio_floor: float) -> tuple[ChangeKind, str, tuple] | None:
    ov, nv = old["verdict"], new["verdict"]
    o_ratio, n_ratio = _ratio(old["worst_ratio"]), _ratio(new["worst_ratio"])
    severity = SEVERITY[nv]
    if is_expected_row(new):
        return ("changed", f"{ov} → {nv} (expected)", (severity, 0)) if ov != nv else None
    if nv in ABORTED and ov != nv:
        return "regression", f"new {nv} (was {ov})", (severity, 0)
    if ov == "pass" and nv in NEW_FAILING:
        return "regression", f"pass → {nv}", (severity, -(n_ratio or 0.0))
    if ov == "pass" and nv == "unsupported":
        return "regression", "pass → unsupported", (SEVERITY["unsupported"], 0)
    if (
        o_ratio is not None and n_ratio is not None and n_ratio >= ratio_floor
        and n_ratio > ratio_factor * o_ratio and nv not in ERRORED
    ):
        growth = "×inf" if o_ratio == 0 else f"×{n_ratio / o_ratio:.3g}"
        return "regression", f"ratio {growth} ({fmt_ratio(o_ratio)} → {fmt_ratio(n_ratio)})", (5, -(n_ratio / max(o_ratio, 1e-300)))
    if ov in FAILING and ov != "flaky" and nv == "pass":
        was_expected = " (was expected to fail)" if is_expected_row(old) else ""
        return "fix", f"{ov} → pass{was_expected}", (SEVERITY[ov], 0)
    if ov != nv:
        return "changed", f"{ov} → {nv}", (severity, 0)
    return None


def diff_frames(
    old: pd.DataFrame, new: pd.DataFrame, *, ratio_factor: float = RATIO_FACTOR, ratio_floor: float = RATIO_FLOOR,
    bad_lines: list[BadLine] | None = None, not_run: Collection[str] = (),
) -> DiffResult:
    """The changes from ``old`` to ``new`` (both one row per case, as ``reports.matrix.latest`` gives);
    ``not_run``: full ids the new run selected but did not run."""
    if ratio_factor <= 1:
        raise ValueError(f"diff: ratio_factor={ratio_factor} must exceed 1 (a growth factor)")
    old_by_id = {row["full_id"]: row for _, row in old.iterrows()}
    new_by_id = {row["full_id"]: row for _, row in new.iterrows()}
    if not old_by_id.keys() & new_by_id.keys():
        raise ValueError(f"the old results ({len(old_by_id)} cases) and the new ({len(new_by_id)} cases) have no "
                         "case in common; compare results of the same selection")
    not_run = set(not_run)
    changes: list[Change] = []
    for full_id, n in new_by_id.items():
        o = old_by_id.get(full_id)
        if o is None:
            nv, expected = n["verdict"], is_expected_row(n)
            kind: ChangeKind = "regression" if nv in ABORTED and not expected else "new"
            what = (f"new case, {nv}" + (" (expected)" if expected else "")) if kind == "new" else f"new {nv} (new case)"
            rank = (SEVERITY[nv], 1)  # after an existing case's change of the same severity
            changes.append(Change(kind, what, full_id, cell_name(n), None, nv, None, _ratio(n["worst_ratio"]), str(n["reason"]),
                                  rank, expected))
            continue
        classified = _classify(o, n, ratio_factor, ratio_floor)
        if classified is not None:
            kind, what, rank = classified
            changes.append(Change(
                kind, what, full_id, cell_name(n), o["verdict"], n["verdict"],
                _ratio(o["worst_ratio"]), _ratio(n["worst_ratio"]), str(n["reason"]), rank, is_expected_row(n),
            ))
    for full_id, o in old_by_id.items():
        if full_id in not_run:
            changes.append(Change(
                "not_run", f"not run (was {o['verdict']})", full_id, cell_name(o), o["verdict"], None,
                _ratio(o["worst_ratio"]), None, str(o["reason"]), (SEVERITY[o["verdict"]], 0),
            ))
        elif full_id not in new_by_id:
            changes.append(Change(
                "removed", f"removed (was {o['verdict']})", full_id, cell_name(o), o["verdict"], None,
                _ratio(o["worst_ratio"]), None, str(o["reason"]), (SEVERITY[o["verdict"]], 0),
            ))
    changes.sort(key=lambda c: (KIND_ORDER[c.kind], c.rank, c.full_id))

    old_cells = {cell_name(row) for row in old_by_id.values()}
    new_cells = list(dict.fromkeys(cell_name(row) for row in new_by_id.values() if cell_name(row) not in old_cells))
    return DiffResult(
        changes=changes, new_cells=new_cells, bad_lines=list(bad_lines or []),
        old_cases=len(old_by_id), new_cases=len(new_by_id),
    )
