"""The collective order of an engine run without prefetch, which the prefetch knob checks compare a case's
order with, computed once per configuration in each rank process.

A case with ``backward_prefetch`` or ``forward_prefetch`` reruns its engine for two steps with the setting
off (``harness.compare.parity.knob_checks``), and the checks read only that run's communication trace.
The trace is the sequence of collectives the engine's Python code issues for a configuration (op, sizes,
dtypes, groups, phase and step: no timing), the same on every run of it, so the cases that share the
configuration without prefetch (``BACKWARD_PRE`` and ``BACKWARD_POST`` of one setting, both references)
read one run. On a CPU nightly sample these reruns were about 30 % of the rank time of the cases.

A case's own run is itself the baseline of the cases that differ from it in a prefetch setting it has off
(``keep_own_run``): the trace of its first ``baseline_steps`` steps is what a baseline run of them records,
since a step's collectives are issued within it (a later step's are marked with their own step) and what
the harness reads after a step is outside the trace. The default nightly's cases ask for a baseline
34,720 times over 10,640 configurations; 32,480 of the asks are for a configuration that is a case of the
nightly itself. The runner's lanes take a trained configuration's cases together in the generator's order,
prefetch off first (``harness.run.case_queue``), and a part holds the whole configuration
(``harness.run.parts``), so there most asks find a sibling's run kept; a time budget's sampled order spreads the
siblings over the run, where they rarely meet on one rank.

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

__all__ = ["BASELINES", "BASELINE_STEPS", "baseline_events", "baseline_key", "baseline_steps", "keep_own_run"]

#: this rank process's baseline traces.
BASELINES: ReferenceCache[list[CommEvent]] = ReferenceCache()

#: steps of a baseline run: the forward order is known from the second step on.
BASELINE_STEPS = 2

RunEngine = Callable[[EngineAdapter, CaseConfig, RankContext, int], Observation]


def baseline_key(case: CaseConfig, steps: int, ctx: RankContext) -> tuple[Any, ...]:
    """Every field of the baseline case but its reference (the engine's run never reads it), the steps and
    where the ranks run."""
    fields = tuple((f.name, getattr(case, f.name)) for f in dataclasses.fields(case) if f.name != "reference")
    return (fields, steps, str(ctx.device), ctx.world_size, ctx.local_world_size)


def baseline_steps(case: CaseConfig) -> int:
    """The steps the prefetch checks compare: ``BASELINE_STEPS``, or the case's own if it trains fewer."""
    return min(BASELINE_STEPS, case.steps)


def keep_own_run(case: CaseConfig, ctx: RankContext, events: list[CommEvent]) -> None:
    """Keep the trace of ``case``'s own run (``events``, all its steps) as the baseline a case that turns one of
    its prefetch settings on would run. Only a plain run is kept: a checkpointed case rebuilds its engine
    half-way (``harness.compare.resume``); a compiled one traces its collectives as dynamo compiles it, and a
    baseline run after it reuses what was compiled; the cache's own rule leaves out faults and stress. Every
    rank runs every case, so each keeps its own; ``baseline_events`` agrees on a hit collectively."""
    if not cacheable(case) or case.checkpoint != "none" or case.compile != "none":
        return
    if case.backward_prefetch != "none" and case.forward_prefetch:
        return  # no check turns a setting on from here: nothing asks for this configuration
    steps = baseline_steps(case)
    BASELINES.put(baseline_key(case, steps, ctx), [e for e in events if e.step < steps])


def baseline_events(run_engine: RunEngine, adapter: EngineAdapter, case: CaseConfig, ctx: RankContext,
                    steps: int) -> list[CommEvent]:
    """The trace of ``run_engine(adapter, case, ctx, steps)``: kept from an earlier case when every rank has
    it, else run (and kept). Collective: every rank calls it alike."""
    key = baseline_key(case, steps, ctx) if cacheable(case) else None
    kept = BASELINES.get(key) if key is not None else None
    if key is not None and consensus(kept is not None, ctx.device):
        BASELINES.hits += 1
        return kept
    events = run_engine(adapter, case, ctx, steps).events
    if key is not None:
        BASELINES.put(key, events)
    return events
