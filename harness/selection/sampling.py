"""The order cases run in when not all of them may: a ``--limit`` or a time budget takes a prefix.

``sample_order`` puts first, for each engine, the fewest cases that show every value of every axis and
then every pair of values of two axes that the selection holds (a greedy cover, as a pairwise covering
array is built), then the rest interleaved (``interleave``: every reference and model before a second
case of any), and deals the engines out in turn. A prefix of any length has then compared every engine
as widely as that many cases can, instead of the generator's first near-identical cases.

The axes are ``harness.selection.matrix.AXES`` (the engine aside: it is dealt out), so an axis added there is
sampled without an edit here. Pure logic over ``CaseConfig``s; deterministic (ties keep the input order).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from harness.cases.case import CaseConfig

__all__ = ["INTERLEAVE_AXES", "interleave", "sample_axes", "sample_order"]

#: the axes ``interleave`` spreads, outermost first.
INTERLEAVE_AXES = ("world_size", "engine", "reference", "model", "sharding_strategy", "precision")


def interleave(cases: Sequence[CaseConfig], axes: Sequence[str] = INTERLEAVE_AXES) -> list[CaseConfig]:
    """The same cases, reordered so every prefix is spread over ``axes``: round robin over the values
    of the first axis (in first-seen order), each value's cases interleaved by the remaining axes."""
    if not axes:
        return list(cases)
    groups: dict[Any, list[CaseConfig]] = {}
    for case in cases:
        groups.setdefault(getattr(case, axes[0]), []).append(case)
    return _deal([interleave(group, axes[1:]) for group in groups.values()])


def _deal(columns: Sequence[Sequence[CaseConfig]]) -> list[CaseConfig]:
    """One case of each column in turn, until every column is spent."""
    out: list[CaseConfig] = []
    for depth in range(max((len(c) for c in columns), default=0)):
        out.extend(column[depth] for column in columns if depth < len(column))
    return out


def sample_axes(cases: Sequence[CaseConfig]) -> list[str]:
    """The axes of ``harness.selection.matrix.AXES`` (but the engine) on which ``cases`` take more than one value."""
    from harness.selection.matrix import AXES

    return [a for a in AXES if a != "engine" and len({getattr(c, a) for c in cases}) > 1]


def _cover_first(cases: Sequence[CaseConfig]) -> list[CaseConfig]:
    """``cases`` with a greedy cover first: each next case shows the most values not yet shown, then
    the most pairs of values not yet shown together; the uncovering rest follows, interleaved."""
    axes = sample_axes(cases)
    singles = [[(a, getattr(c, a)) for a in axes] for c in cases]
    pairs = [list(itertools.combinations(s, 2)) for s in singles]
    seen_singles: set[Any] = set()
    seen_pairs: set[Any] = set()

    def gain(i: int) -> tuple[int, int]:
        return (sum(1 for s in singles[i] if s not in seen_singles), sum(1 for p in pairs[i] if p not in seen_pairs))

    # Lazy greedy: a case's gain only shrinks as others are taken, so a stale gain is an upper bound.
    heap = [(-g[0], -g[1], i) for i, g in ((i, gain(i)) for i in range(len(cases)))]
    heapq.heapify(heap)
    first: list[int] = []
    while heap:
        _, _, i = heapq.heappop(heap)
        now = gain(i)
        if now == (0, 0):
            continue  # covers nothing new: it goes with the rest
        if heap and (-now[0], -now[1], i) > heap[0]:
            heapq.heappush(heap, (-now[0], -now[1], i))
            continue
        first.append(i)
        seen_singles.update(singles[i])
        seen_pairs.update(pairs[i])
    taken = set(first)
    return [cases[i] for i in first] + interleave([c for i, c in enumerate(cases) if i not in taken])


def sample_order(cases: Sequence[CaseConfig]) -> list[CaseConfig]:
    """The same cases, each engine's covering sample first (values, then pairs), engines dealt in turn."""
    engines: dict[str, list[CaseConfig]] = {}
    for case in cases:
        engines.setdefault(case.engine_name, []).append(case)
    return _deal([_cover_first(group) for group in engines.values()])
