"""How much a certificate covered: per family of generated cases, the strategy and precision values the
engine declares (``declared_values``: every value some valid case of the engine holds at the
certificate's world size) that no case of the family ran, and the verdict that follows.

A certificate CONFORMS only where no family failed and every case family that ran anything ran at least
one case for every declared strategy and precision; where one did not, it is PARTIAL, naming what did not
run. A value a family cannot judge by design is out of its scope (``FAMILY_SCOPE``: DDP computes in full
precision, so mixed precision is judged against the local reference only). Pure: plain data in, plain
data out (``declared_values`` asks the matrix, which resolves the engine's rules).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from harness.cases.case import PRECISIONS

__all__ = ["COVERAGE_AXES", "FAMILY_SCOPE", "Verdict", "coverage_lines", "declared_values", "family_coverage", "verdict"]

#: the axes a certificate must cover for every value the engine declares.
COVERAGE_AXES: tuple[str, ...] = ("sharding_strategy", "precision")
Verdict = Literal["CONFORMS", "PARTIAL", "DOES NOT CONFORM"]
#: verdicts of a case that did not run the engine's training (the others ran it, well or not).
NOT_RUN = ("unsupported",)

#: family -> ``(axis, value) -> whether the family can judge that value at all``; a family not named
#: judges every value.
FAMILY_SCOPE: dict[str, Callable[[str, Any], bool]] = {
    "parity-ddp": lambda axis, value: not (axis == "precision" and PRECISIONS[value].is_mixed),
}


def declared_values(spec: str, world_size: int) -> dict[str, list[Any]]:
    """Per ``COVERAGE_AXES`` axis, the values some valid case of engine ``spec`` holds at ``world_size``
    (what its adapter's strategies and capability rules leave), in axis order."""
    from harness.selection.matrix import feasible_pairs, resolve_axes

    pairs = feasible_pairs(axes={"engine": [spec], "world_size": [world_size]})
    held = {value for pair in pairs for value in pair}
    axes, _ = resolve_axes({"engine": [spec], "world_size": [world_size]})
    return {axis: [v for v in axes[axis] if (axis, v) in held] for axis in COVERAGE_AXES}


def family_coverage(family: str, cases: Sequence[Mapping[str, Any]], declared: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """Per axis, the declared values in the family's scope that none of ``cases`` (the case dicts of the
    records that ran) holds; empty lists where every value ran."""
    judges = FAMILY_SCOPE.get(family, lambda axis, value: True)
    ran = {(axis, case.get(axis)) for case in cases for axis in declared}
    return {axis: [v for v in values if judges(axis, v) and (axis, v) not in ran] for axis, values in declared.items()}


def verdict(ok: bool, coverage: Mapping[str, Mapping[str, Sequence[Any]]]) -> Verdict:
    """``DOES NOT CONFORM`` where a family failed (``ok`` false), else ``PARTIAL`` where some family left a
    declared value unrun, else ``CONFORMS``."""
    if not ok:
        return "DOES NOT CONFORM"
    return "PARTIAL" if any(values for missing in coverage.values() for values in missing.values()) else "CONFORMS"


def coverage_lines(coverage: Mapping[str, Mapping[str, Sequence[Any]]]) -> list[str]:
    """One line per family: the axis values it never exercised, or that it covered every one."""
    lines = []
    for family, missing in coverage.items():
        gaps = [f"{axis} {', '.join(map(str, values))}" for axis, values in missing.items() if values]
        lines.append(f"{family}: never exercised {'; '.join(gaps)}" if gaps else f"{family}: every declared value ran")
    return lines
