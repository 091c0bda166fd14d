"""What a run left out: the cases it selected but did not run, and why; pure, over plain data.

A nightly with a time budget, or one whose pools failed, records fewer cases than it selected. Its
``nightly.json`` says how many were selected and why the rest were not run, and ``not_run.txt`` lists
them (``harness.cases.records.NotRun``: full id, why and config per line). Every report page opens with a
banner built from a ``RunScope`` so a partial run never reads as complete.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from harness.cases.records import NotRun
from reports.matrix import AXIS_COLUMNS, case_axes

#: The key under which ``summary.json``'s scope and a merged night's ``nightly.json`` keep the parts of a
#: run (``RunScope.parts``): "shards", the name these files had before "part" meant a part of a run; kept so
#: that earlier files stay readable and every file's key the same.
PARTS_KEY = "shards"


@dataclass
class RunScope:
    """How much of its selection a run ran."""

    #: cases the run selected (None when unknown).
    selected: int | None = None
    #: every selected case that was not run.
    not_run: list[NotRun] = field(default_factory=list)
    #: why cases were not even selected (``world size 4: 35 cases: needs 4 GPUs``).
    not_selected: list[str] = field(default_factory=list)
    #: where this came from (``nightly.json``, ``not_run.txt``, the command line).
    source: str = ""
    #: the parts of a run split into parts that are missing or unfinished (``part_problems``), one phrase each.
    parts: list[str] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.not_run or self.not_selected or self.parts)

    def reasons(self) -> dict[str, int]:
        """Cases not run per reason, most first."""
        return dict(collections.Counter(n.why for n in self.not_run).most_common())

    def banner(self) -> str:
        """One sentence for the top of every page; empty when the run was whole."""
        parts = []
        if self.parts:
            parts.append(f"Incomplete run: {'; '.join(self.parts)}; the tables count only the cases recorded.")
        if self.not_run:
            of = f" of {self.selected:,}" if self.selected is not None else ""
            why = "; ".join(f"{why} ({n:,})" if len(self.reasons()) > 1 else why for why, n in self.reasons().items())
            parts.append(f"Partial run: {len(self.not_run):,}{of} selected cases were not run ({why}); "
                         "the tables count only the cases that ran.")
        parts += [f"Not selected: {line}." for line in self.not_selected]
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"selected": self.selected, "not_run": len(self.not_run), "reasons": self.reasons(),
                "not_selected": list(self.not_selected), "source": self.source,
                **({PARTS_KEY: list(self.parts)} if self.parts else {})}


def scope_from_nightly(state: Mapping[str, Any], not_run: Sequence[NotRun] = ()) -> RunScope:
    """The scope ``nightly.json`` describes; ``not_run`` from ``not_run.txt`` when it exists.

    Without the list, ``nightly.json``'s counts per reason stand in (the banner needs only counts).
    """
    cases = state.get("cases") or {}
    listed = list(not_run)
    if not listed and cases.get("not_run"):
        for why, n in (cases.get("not_run_reasons") or {"not run": cases["not_run"]}).items():
            listed += [NotRun("", why)] * int(n)
    skipped = [
        f"world size {ws}: {info.get('cases', '?')} case(s): {info.get('reason', '')}"
        for ws, info in (cases.get("world_sizes_skipped") or {}).items()
    ]
    selected = cases.get("selected")
    # A merged night's missing or unfinished parts, in the section its nightly.json keeps under PARTS_KEY.
    parts = [str(p) for p in (state.get(PARTS_KEY) or {}).get("problems") or []]
    return RunScope(int(selected) if selected is not None else None, listed, skipped, "nightly.json", parts)


def merge_scopes(scopes: Iterable[RunScope]) -> RunScope | None:
    """One scope for a report of several inputs; None when none says anything."""
    scopes = [s for s in scopes if s is not None]
    if not scopes:
        return None
    selected = None if any(s.selected is None for s in scopes) else sum(s.selected or 0 for s in scopes)
    return RunScope(
        selected, [x for s in scopes for x in s.not_run], [x for s in scopes for x in s.not_selected],
        ", ".join(dict.fromkeys(s.source for s in scopes if s.source)), [x for s in scopes for x in s.parts],
    )


@dataclass(frozen=True)
class PartInput:
    """One input of a report that is a part of a run (``harness.run.parts``), as its stored selection says."""

    #: the results file.
    path: str
    #: the stored selection's part (its on-disk key is ``shard``, kept so that earlier runs stay readable):
    #: ``index`` (0-based), ``count``, ``partition``, ``case_ids``.
    part: Mapping[str, Any]
    #: every case id of the whole selection.
    selection: Sequence[str]
    #: the full ids the file records.
    recorded: frozenset[str]
    #: the full ids its run listed as not run (a time budget): left out on purpose, not unfinished.
    not_run: frozenset[str] = frozenset()


class PartMismatch(ValueError):
    """Inputs that are parts of different partitions: not parts of one run."""


def part_problems(inputs: Sequence[PartInput]) -> list[str]:
    """What keeps the parts given from being the whole run: each missing part (with the cases no given
    part holds) and each unfinished one (cases of its part neither recorded nor listed as not run).
    Raises ``PartMismatch`` naming two inputs of different partitions."""
    if not inputs:
        return []
    first = inputs[0]
    for other in inputs[1:]:
        if other.part.get("partition") != first.part.get("partition"):
            raise PartMismatch(
                f"{other.path} is part {other.part['index'] + 1}/{other.part['count']} of partition "
                f"{other.part.get('partition')}, {first.path} part {first.part['index'] + 1}/{first.part['count']} of "
                f"{first.part.get('partition')}: parts of different partitions (another N, selection or costs) "
                "are not one run; give the parts of one partition")
    count = int(first.part["count"])
    present = {int(i.part["index"]) for i in inputs}
    held = {c for i in inputs for c in i.part["case_ids"]}
    out = []
    missing = sorted(set(range(count)) - present)
    if missing:
        lost = len(set(first.selection) - held)
        names = ", ".join(f"{k + 1}/{count}" for k in missing)
        out.append(f"part{'s' if len(missing) > 1 else ''} {names} missing ({lost:,} case{'s' if lost != 1 else ''})")
    recorded = {c for i in inputs for c in i.recorded}
    not_run = {c for i in inputs for c in i.not_run}
    for i in sorted(inputs, key=lambda i: int(i.part["index"])):
        left = [c for c in i.part["case_ids"] if c not in recorded and c not in not_run]
        if left:
            out.append(f"part {int(i.part['index']) + 1}/{count} unfinished ({len(left):,} of "
                       f"{len(i.part['case_ids']):,} cases not recorded: --resume it)")
    return out


def not_run_frame(scope: RunScope | None) -> pd.DataFrame:
    """The not-run cases whose config the list recorded, one row each with their axes (read from the config,
    as ``reports.matrix.records_frame`` reads a record's) and ``why``."""
    rows = [{"full_id": n.full_id, **case_axes(n.case), "why": n.why}
            for n in (scope.not_run if scope is not None else []) if n.case is not None]
    return pd.DataFrame(rows, columns=["full_id", *AXIS_COLUMNS, "why"])
