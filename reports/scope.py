"""What a run left out: the cases it selected but did not run, and why; pure, over plain data.

A nightly with a time budget, or one whose pools failed, records fewer cases than it selected. Its
``nightly.json`` says how many were selected and why the rest were not run, and ``not_run.txt`` lists
them (``<full id>\\t<why>`` per line). Every report page opens with a banner built from a ``RunScope``
so a partial run never reads as complete.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import pandas as pd

from harness.case import (
    CHECKPOINT_SEGMENTS,
    LOOP_SEGMENTS,
    InitModeName,
    OptimizerName,
    PrecisionName,
    PrefetchName,
    ShardingName,
)


@dataclass
class RunScope:
    """How much of its selection a run ran."""

    #: cases the run selected (None when unknown).
    selected: int | None = None
    #: ``(full id, why)`` of every selected case that was not run.
    not_run: list[tuple[str, str]] = field(default_factory=list)
    #: why cases were not even selected (``world size 4: 35 cases: needs 4 GPUs``).
    not_selected: list[str] = field(default_factory=list)
    #: where this came from (``nightly.json``, ``not_run.txt``, the command line).
    source: str = ""
    #: the shards of a sharded run that are missing or unfinished (``shard_problems``), one phrase each.
    shards: list[str] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.not_run or self.not_selected or self.shards)

    def reasons(self) -> dict[str, int]:
        """Cases not run per reason, most first."""
        return dict(collections.Counter(why for _, why in self.not_run).most_common())

    def banner(self) -> str:
        """One sentence for the top of every page; empty when the run was whole."""
        parts = []
        if self.shards:
            parts.append(f"Incomplete run: {'; '.join(self.shards)}; the tables count only the cases recorded.")
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
                **({"shards": list(self.shards)} if self.shards else {})}


def parse_not_run(text: str) -> list[tuple[str, str]]:
    """``not_run.txt``'s lines as ``(full id, why)``; a line without a reason gets ``not run``."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        full_id, _, why = line.partition("\t")
        out.append((full_id.strip(), why.strip() or "not run"))
    return out


def scope_from_nightly(state: Mapping[str, Any], not_run: Sequence[tuple[str, str]] = ()) -> RunScope:
    """The scope ``nightly.json`` describes; ``not_run`` from ``not_run.txt`` when it exists.

    Without the list, ``nightly.json``'s counts per reason stand in (the banner needs only counts).
    """
    cases = state.get("cases") or {}
    listed = list(not_run)
    if not listed and cases.get("not_run"):
        for why, n in (cases.get("not_run_reasons") or {"not run": cases["not_run"]}).items():
            listed += [("", why)] * int(n)
    skipped = [
        f"world size {ws}: {info.get('cases', '?')} case(s): {info.get('reason', '')}"
        for ws, info in (cases.get("world_sizes_skipped") or {}).items()
    ]
    selected = cases.get("selected")
    shards = [str(p) for p in (state.get("shards") or {}).get("problems") or []]  # a merged night's
    return RunScope(int(selected) if selected is not None else None, listed, skipped, "nightly.json", shards)


def merge_scopes(scopes: Iterable[RunScope]) -> RunScope | None:
    """One scope for a report of several inputs; None when none says anything."""
    scopes = [s for s in scopes if s is not None]
    if not scopes:
        return None
    selected = None if any(s.selected is None for s in scopes) else sum(s.selected or 0 for s in scopes)
    return RunScope(
        selected, [x for s in scopes for x in s.not_run], [x for s in scopes for x in s.not_selected],
        ", ".join(dict.fromkeys(s.source for s in scopes if s.source)), [x for s in scopes for x in s.shards],
    )


@dataclass(frozen=True)
class ShardInput:
    """One input of a report that is a shard of a run (``harness.shards``), as its stored selection says."""

    #: the results file.
    path: str
    #: the stored selection's ``shard``: ``index`` (0-based), ``count``, ``partition``, ``case_ids``.
    shard: Mapping[str, Any]
    #: every case id of the whole selection.
    selection: Sequence[str]
    #: the full ids the file records.
    recorded: frozenset[str]
    #: the full ids its run listed as not run (a time budget): left out on purpose, not unfinished.
    not_run: frozenset[str] = frozenset()


class ShardMismatch(ValueError):
    """Inputs that are shards of different partitions: not parts of one run."""


def shard_problems(inputs: Sequence[ShardInput]) -> list[str]:
    """What keeps the shards given from being the whole run: each missing shard (with the cases no given
    shard holds) and each unfinished one (cases of its part neither recorded nor listed as not run).
    Raises ``ShardMismatch`` naming two inputs of different partitions."""
    if not inputs:
        return []
    first = inputs[0]
    for other in inputs[1:]:
        if other.shard.get("partition") != first.shard.get("partition"):
            raise ShardMismatch(
                f"{other.path} is shard {other.shard['index'] + 1}/{other.shard['count']} of partition "
                f"{other.shard.get('partition')}, {first.path} shard {first.shard['index'] + 1}/{first.shard['count']} of "
                f"{first.shard.get('partition')}: shards of different partitions (another N, selection or costs) "
                "are not one run; give the shards of one partition")
    count = int(first.shard["count"])
    present = {int(i.shard["index"]) for i in inputs}
    held = {c for i in inputs for c in i.shard["case_ids"]}
    out = []
    missing = sorted(set(range(count)) - present)
    if missing:
        lost = len(set(first.selection) - held)
        names = ", ".join(f"{k + 1}/{count}" for k in missing)
        out.append(f"shard{'s' if len(missing) > 1 else ''} {names} missing ({lost:,} case{'s' if lost != 1 else ''})")
    recorded = {c for i in inputs for c in i.recorded}
    not_run = {c for i in inputs for c in i.not_run}
    for i in sorted(inputs, key=lambda i: int(i.shard["index"])):
        left = [c for c in i.shard["case_ids"] if c not in recorded and c not in not_run]
        if left:
            out.append(f"shard {int(i.shard['index']) + 1}/{count} unfinished ({len(left):,} of "
                       f"{len(i.shard['case_ids']):,} cases not recorded: --resume it)")
    return out


_PRECISIONS = sorted(get_args(PrecisionName), key=len, reverse=True)
_STRATEGIES = sorted(get_args(ShardingName), key=len, reverse=True)
_ID = re.compile(
    r"^(?P<engine>[^:]+):(?P<reference>[^:]+):(?P<sharding_strategy>" + "|".join(_STRATEGIES) + r")-"
    r"(?P<precision>" + "|".join(_PRECISIONS) + r")-bwd_(?P<backward_prefetch>" + "|".join(get_args(PrefetchName)) + r")"
    r"(?P<fwd>-fwd_prefetch)?(?P<offload>-offload)?(?P<orig>-orig)?"
    r"(?:-init_(?P<init_mode>" + "|".join(get_args(InitModeName)) + r"))?"
    r"-(?P<model>[A-Za-z0-9_]+)(?:-ws(?P<world_size>\d+))?(?:-steps(?P<steps>\d+))?"
    r"(?:-(?P<optimizer>" + "|".join(o for o in get_args(OptimizerName) if o != "sgd") + r"))?"
    r"(?:-(?P<checkpoint>" + "|".join(CHECKPOINT_SEGMENTS.values()) + r")(?:-\d+to\d+)?)?"
    r"(?:-resume_(?P<resume_engine>.+?))?(?:-stress_(?P<stress>delay))?"
    + "".join(f"(?:-(?P<{axis}>" + "|".join(names.values()) + "))?" for axis, names in LOOP_SEGMENTS.items())
    + "$"
)
_CHECKPOINTS = {segment: name for name, segment in CHECKPOINT_SEGMENTS.items()}
#: per training-loop axis: id segment -> value.
_LOOP_VALUES = {axis: {segment: value for value, segment in names.items()} for axis, names in LOOP_SEGMENTS.items()}


def case_from_full_id(full_id: str) -> dict[str, Any] | None:
    """The axes of a case from its full id (``harness.case.CaseConfig.full_id``); None if it is not one."""
    m = _ID.match(full_id)
    if m is None:
        return None
    return {
        "full_id": full_id, "engine": m["engine"], "reference": m["reference"], "model": m["model"],
        "sharding_strategy": m["sharding_strategy"], "precision": m["precision"],
        "backward_prefetch": m["backward_prefetch"], "forward_prefetch": bool(m["fwd"]),
        "cpu_offload": bool(m["offload"]), "use_orig_params": bool(m["orig"]),
        "init_mode": m["init_mode"] or "before", "world_size": int(m["world_size"] or 2),
        "steps": int(m["steps"] or 5), "optimizer": m["optimizer"] or "sgd",
        "checkpoint": _CHECKPOINTS.get(m["checkpoint"] or "", "none"), "resume_engine": m["resume_engine"] or "",
        **{axis: values.get(m[axis] or "", "none") for axis, values in _LOOP_VALUES.items()},
    }


def not_run_frame(scope: RunScope | None) -> pd.DataFrame:
    """The not-run cases whose ids parse, one row each with their axes and ``why``."""
    rows = []
    for full_id, why in scope.not_run if scope is not None else []:
        case = case_from_full_id(full_id)
        if case is not None:
            rows.append({**case, "why": why})
    columns = ["full_id", "engine", "reference", "model", "sharding_strategy", "precision", "backward_prefetch",
               "forward_prefetch", "cpu_offload", "use_orig_params", "init_mode", "world_size", "steps",
               "optimizer", "checkpoint", "resume_engine", *LOOP_SEGMENTS, "why"]
    return pd.DataFrame(rows, columns=columns)
