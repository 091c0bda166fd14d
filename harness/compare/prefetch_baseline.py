"""The collective order of an engine run without prefetch, which the prefetch knob checks compare a case's
order with, computed once per configuration in each rank process.

A case with ``backward_prefetch`` or ``forward_prefetch`` reruns its engine for two steps with the setting
off (``harness.compare.parity.knob_checks``), and the checks read only that run's communication trace.
The trace is the sequence of collectives the engine's Python code issues for a configuration (op, sizes,
dtypes, groups, phase and step: no timing), the same on every run of it, so the cases that share the
configuration without prefetch (``BACKWARD_PRE`` and ``BACKWARD_POST`` of one setting, both references)
read one run. On a CPU nightly sample these reruns were about 30 % of the rank time of the cases.

Cases with an injected fault or stress delays never use it, and the ranks agree on a hit collectively
(``harness.compare.reference_cache.consensus``), as for the references.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.cases.case import CaseConfig
from harness.compare.compare import Observation
from harness.compare.reference_cache import ReferenceCache, cacheable, consensus
from harness.compare.trace import CommEvent
from harness.engines.adapters import EngineAdapter
from harness.ranks.rank import RankContext

__all__ = ["BASELINES", "baseline_events", "baseline_key"]

#: this rank process's baseline traces.
BASELINES: ReferenceCache[list[CommEvent]] = ReferenceCache()

RunEngine = Callable[[EngineAdapter, CaseConfig, RankContext, int], Observation]


def baseline_key(case: CaseConfig, steps: int, ctx: RankContext) -> tuple[Any, ...]:
    """Every field of the baseline case but its reference (the engine's run never reads it), the steps and
    where the ranks run."""
    fields = tuple((f.name, getattr(case, f.name)) for f in dataclasses.fields(case) if f.name != "reference")
    return (fields, steps, str(ctx.device), ctx.world_size, ctx.local_world_size)


def baseline_events(run_engine: RunEngine, adapter: EngineAdapter, case: CaseConfig, ctx: RankContext,
                    steps: int) -> list[CommEvent]:
    """The trace of ``run_engine(adapter, case, ctx, steps)``: kept from an earlier case when every rank has
    it, else run (and kept). Collective: every rank calls it alike."""
    key = baseline_key(case, steps, ctx) if cacheable(case) else None
    kept = BASELINES.get(key) if key is not None else None
    if key is not None and consensus(kept is not None, ctx.device):
        return kept
    events = run_engine(adapter, case, ctx, steps).events
    if key is not None:
        BASELINES.put(key, events)
    return events
