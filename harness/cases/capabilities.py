"""What an engine cannot express, as data: capability rules over the case axes.

A ``Rule`` rules combinations of axis values out, with the reason. The matrix has a few rules of its own
(constraints every FSDP user meets, ``harness.selection.matrix.RULES``); every other constraint belongs to one
engine and is declared by its adapter (``EngineAdapter.capability_rules``), so a new engine needs no
edit of the matrix. ``for_engine`` turns an adapter's rule into a matrix rule that also reads the
``engine`` axis, which keeps the pairwise generator's feasibility search exact (it searches the axes
rules read).

Pure: plain data and functions, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Rule", "first_reason", "for_engine", "prefixed_rule"]


@dataclass(frozen=True)
class Rule:
    """A constraint: every combination it matches is invalid, for ``reason``."""

    #: short identifier, for tests and for filtering rules.
    name: str
    #: the ``CaseConfig`` fields it reads; it is evaluated once all of them are known.
    axes: tuple[str, ...]
    #: one line: why such a case cannot run.
    reason: str
    #: True when the case (a mapping holding at least ``axes``) is invalid.
    matches: Callable[[Mapping[str, Any]], bool]


def prefixed_rule(prefix: str, name: str, axes: tuple[str, ...], reason: str,
                  matches: Callable[[Mapping[str, Any]], bool]) -> Rule:
    """A rule named ``PREFIX_NAME``: the adapters of engines we did not write name theirs by engine."""
    return Rule(f"{prefix}_{name}", axes, reason, matches)


def for_engine(engine: str, label: str, rule: Rule) -> Rule:
    """``rule`` of the engine whose ``CaseConfig.engine`` is ``engine``, as a rule of the whole matrix.

    ``label`` (the engine's name) prefixes the reason so a pruned case says whose limit it met.
    """
    inner = rule.matches

    def matches(case: Mapping[str, Any]) -> bool:
        return case["engine"] == engine and inner(case)

    axes = rule.axes if "engine" in rule.axes else ("engine", *rule.axes)
    return Rule(rule.name, axes, f"{label}: {rule.reason}", matches)


def first_reason(rules: Sequence[Rule], values: Mapping[str, Any]) -> str | None:
    """The reason of the first rule ``values`` break (a mapping holding every axis the rules read), or None."""
    for rule in rules:
        if rule.matches(values):
            return rule.reason
    return None
