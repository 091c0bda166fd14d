"""Failure attribution: which settings make cases fail, as short conjunctions of axis values.

Pure functions over a ``latest`` frame (one row per case). For each engine and reference, the cases
that ran are split into failing (fail, error, timeout, crash) and passing ones; ``unsupported`` cases
ran nothing and take no side, and neither do expected failures (``reports.matrix.is_expected_failure``:
known engine bugs the suites hold as strict expectations, explained by their own reason). A *term*
is a conjunction of up to ``max_literals`` axis values, each from a different axis (``no_shard &
offload & orig``), that matches at least one failing case and no passing case. The explanation is a greedy set cover of the failing cases by such terms.

[Note: how terms are chosen]
- Candidates are every conjunction of 1 to ``max_literals`` values seen among the failing cases that
  matches no passing case. A candidate that contains a shorter candidate is dropped: the shorter one
  covers at least as much and says it with fewer words.
- Greedy: take the candidate covering the most failing cases not covered yet; ties go to fewer
  literals, then to more failing cases in all, then to the display text (alphabetical), so the
  result is deterministic. Repeat until nothing more is covered.
- A term that explains fewer than ``min_support`` failing cases is not a pattern: in a sparse matrix
  (pairwise) almost any single case is isolated by some three values. Those cases are reported as
  unexplained together with the cases no short term separates from passing ones (noise, flakes, or a
  cause that needs more than ``max_literals`` settings).

[Note: intermittent failures]
A race fails some runs of a configuration and passes others, so no term separates its failures from
passing cases, and "not separated" alone would hide where it lives. When the unexplained failing cases
all share axis values that narrow the cases that ran, the conjunction of up to ``max_literals`` of them
matching the fewest passing cases is reported with its failure rate (``Shared``): every such failure
has these settings, and some cases with them pass too (torch FSDP1's NO_SHARD offload race on shared
GPUs: ``no_shard & offload & orig``, about half of those cases fail in a night).

[Note: evidence before coincidence]
Axis values only correlate; a knob check that failed (``ignored_knobs``: the communication trace shows
a setting without its effect, such as reductions in the wrong dtype) names a cause. The knobs the failing
cases' checks name come first, with their counts. A sample with fewer than ``MIN_CASES_PER_VALUE`` cases
per axis value seen in it (a smoke or pairwise run of one engine) cannot tell a cause from a coincidence:
the attribution says so, and its terms are candidates only.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from harness.cases.records import FAILING
from reports.matrix import AXIS_COLUMNS, expected_failures, ordered

#: Axes a term may use: everything that describes a case except the engine and reference it is grouped by.
TERM_AXES: tuple[str, ...] = tuple(a for a in AXIS_COLUMNS if a not in ("engine", "reference"))
MAX_LITERALS = 3
MIN_SUPPORT = 2
#: cases per axis value a sample needs before its terms are more than candidates (see the module note).
MIN_CASES_PER_VALUE = 2


@dataclass(frozen=True, order=True)
class AxisValue:
    """One literal of a term: ``axis == value``."""

    axis: str
    value: Any

    def __str__(self) -> str:
        # The spelling of case ids (``harness.cases.case.CaseConfig.case_id``), so a term reads like the ids it matches.
        a, v = self.axis, self.value
        if isinstance(v, (bool, np.bool_)):
            short = {"cpu_offload": "offload", "use_orig_params": "orig", "forward_prefetch": "fwd_prefetch"}.get(a, a)
            return short if v else f"not {short}"
        if a == "backward_prefetch":
            return f"bwd_{v}"
        if a == "init_mode":
            return f"init_{v}"
        if a == "world_size":
            return f"ws{v}"
        if a == "steps":
            return f"steps{v}"
        return str(v)


@dataclass
class Term:
    """A conjunction that matches failing cases only."""

    literals: tuple[AxisValue, ...]
    #: failing cases it matches (all of them, not only those it was the first to cover).
    covered: int
    #: failing cases it covered that no earlier term did.
    newly_covered: int
    #: full ids of the failing cases it matches, sorted.
    cases: list[str] = field(repr=False)

    @property
    def text(self) -> str:
        return _conjunction(self.literals)

    def to_dict(self) -> dict[str, Any]:
        return {
            "term": self.text,
            "literals": _literals_dict(self.literals),
            "covered": self.covered, "newly_covered": self.newly_covered, "cases": list(self.cases),
        }


@dataclass(frozen=True)
class Shared:
    """The settings every unexplained failing case has, and how often cases with them fail."""

    literals: tuple[AxisValue, ...]
    #: unexplained failing cases (all of them match).
    failing: int
    #: cases that ran with these settings, failing and passing.
    matched: int

    @property
    def text(self) -> str:
        return _conjunction(self.literals)

    def line(self, code: Callable[[str], str] = lambda text: f"`{text}`") -> str:
        """One sentence; ``code`` marks up the settings (Markdown backquotes by default)."""
        rate = 100.0 * self.failing / self.matched
        return (f"all {self.failing} share {code(self.text)}: {self.failing} of the {self.matched} cases with these "
                f"settings fail ({rate:.0f} %), the others pass: an intermittent failure (a race or a flake) "
                "confined to them")

    def to_dict(self) -> dict[str, Any]:
        return {"term": self.text, "literals": _literals_dict(self.literals), "failing": self.failing, "matched": self.matched}


@dataclass
class Attribution:
    """The explanation of one engine's failures against one reference."""

    engine: str
    reference: str
    failing: int
    passing: int
    terms: list[Term]
    #: failing cases no term of at least ``min_support`` cases explains, sorted.
    unexplained: list[str]
    max_literals: int = MAX_LITERALS
    #: knob -> failing cases whose knob check found that setting ignored, most first.
    knobs: dict[str, int] = field(default_factory=dict)
    #: the sample has fewer than ``MIN_CASES_PER_VALUE`` cases per axis value: terms are candidates only.
    too_small: bool = False
    #: what every unexplained failing case shares, where that narrows the cases (see the module note).
    shared: Shared | None = None
    #: expected failures left out (known engine bugs with their own reason; see the module docstring).
    expected: int = 0

    def counts(self, passing: str = "pass") -> str:
        """``3 pass`` or ``3 pass, 8 expected failure(s) not attributed``: the cases beside the failing ones."""
        return f"{self.passing} {passing}" + (f", {self.expected} expected failure(s) not attributed" if self.expected else "")

    @property
    def explained(self) -> int:
        return self.failing - len(self.unexplained)

    @property
    def separable(self) -> bool:
        """Every failing case is covered by a short term."""
        return not self.unexplained

    def lines(self) -> list[str]:
        """Plain-text sentences, shared by the Markdown and HTML reports."""
        head = f"{self.engine} vs {self.reference}"
        if not self.failing:
            return [f"{head}: no failing case ({self.counts()})."]
        out = self.evidence()
        out += [f"`{t.text}`: {t.covered}/{self.failing} failing case(s), no passing case" for t in self.terms]
        if self.unexplained:
            n = len(self.unexplained)
            out.append(
                f"{n}/{self.failing} failing case(s) not separated from the passing ones by any conjunction "
                f"of up to {self.max_literals} axis values shared by two or more failing cases"
            )
            if self.shared is not None:
                out.append(self.shared.line())
        return out

    def evidence(self) -> list[str]:
        """What outweighs the terms: the knob checks naming a cause, and a sample too small to attribute."""
        out = [f"knob check `{knob}`: ignored in {n}/{self.failing} failing case(s), a cause the trace shows"
               for knob, n in self.knobs.items()]
        if self.too_small:
            out.append(f"{self.failing + self.passing} case(s) are too few to attribute by axis values (fewer than "
                       f"{MIN_CASES_PER_VALUE} per value): the terms below are candidates, not causes; "
                       "run a larger matrix to attribute")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "knobs": dict(self.knobs), "too_small": self.too_small,
            "engine": self.engine, "reference": self.reference, "failing": self.failing,
            "passing": self.passing, "expected": self.expected, "explained": self.explained, "separable": self.separable,
            "max_literals": self.max_literals, "terms": [t.to_dict() for t in self.terms],
            "unexplained": list(self.unexplained),
            "shared": self.shared.to_dict() if self.shared is not None else None,
        }


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _conjunction(literals: Sequence[AxisValue]) -> str:
    return " & ".join(str(lit) for lit in literals)


def _literals_dict(literals: Sequence[AxisValue]) -> list[dict[str, Any]]:
    return [{"axis": lit.axis, "value": _plain(lit.value)} for lit in literals]


def _literal_masks(cases: pd.DataFrame, axes: Sequence[str]) -> dict[AxisValue, np.ndarray]:
    masks: dict[AxisValue, np.ndarray] = {}
    for axis in axes:
        column = cases[axis].to_numpy()
        for value in ordered(axis, cases[axis]):
            masks[AxisValue(axis, _plain(value))] = column == value
    return masks


def _sort_key(lits: Iterable[AxisValue]) -> tuple[int, ...]:
    return tuple(TERM_AXES.index(lit.axis) if lit.axis in TERM_AXES else 99 for lit in lits)


def explain(
    cases: pd.DataFrame, *, max_literals: int = MAX_LITERALS, min_support: int = MIN_SUPPORT,
    axes: Sequence[str] = TERM_AXES,
) -> tuple[list[Term], list[str], int, int]:
    """Terms explaining the failing rows of ``cases`` (one engine and reference); see the module note.

    Returns ``(terms, unexplained full ids, failing, passing)``.
    """
    if max_literals < 1:
        raise ValueError(f"attribution: max_literals={max_literals} must be at least 1")
    ran = cases[cases["verdict"] != "unsupported"].reset_index(drop=True)
    fail = ran["verdict"].isin(FAILING).to_numpy()
    ids = ran["full_id"].to_numpy()
    n_fail, n_pass = int(fail.sum()), int((ran["verdict"] == "pass").sum())
    if not n_fail:
        return [], [], 0, n_pass
    axes = [a for a in axes if a in ran.columns]
    masks = _literal_masks(ran, axes)
    passing = ran["verdict"].to_numpy() == "pass"
    # Literals that hold for some failing case: the only ones a term can use.
    usable = [lit for lit, m in masks.items() if (m & fail).any()]

    valid: dict[tuple[AxisValue, ...], np.ndarray] = {}
    for size in range(1, max_literals + 1):
        for combo in itertools.combinations(usable, size):
            if len({lit.axis for lit in combo}) < size:
                continue
            if any(sub in valid for k in range(1, size) for sub in itertools.combinations(combo, k)):
                continue  # a shorter term inside it already separates; see the module note
            match = np.logical_and.reduce([masks[lit] for lit in combo])
            if (match & passing).any() or not (match & fail).any():
                continue
            valid[combo] = match & fail

    terms: list[Term] = []
    uncovered = fail.copy()
    candidates = sorted(valid.items(), key=lambda kv: (len(kv[0]), _sort_key(kv[0]), [str(x) for x in kv[0]]))
    while True:
        best: tuple[tuple[AxisValue, ...], np.ndarray] | None = None
        best_key: tuple[Any, ...] | None = None
        for combo, match in candidates:
            gain = int((match & uncovered).sum())
            if gain < min_support:
                continue
            key = (-gain, len(combo), -int(match.sum()), " & ".join(str(x) for x in combo))
            if best_key is None or key < best_key:
                best, best_key = (combo, match), key
        if best is None:
            break
        combo, match = best
        gain = int((match & uncovered).sum())
        terms.append(Term(tuple(sorted(combo, key=lambda lit: _sort_key([lit]))), int(match.sum()), gain,
                          sorted(str(i) for i in ids[match])))
        uncovered &= ~match
    return terms, sorted(str(i) for i in ids[uncovered]), n_fail, n_pass


def shared_settings(
    cases: pd.DataFrame, unexplained: Sequence[str], *, max_literals: int = MAX_LITERALS,
    min_support: int = MIN_SUPPORT, axes: Sequence[str] = TERM_AXES,
) -> Shared | None:
    """What the ``unexplained`` failing rows of ``cases`` (one engine and reference) all share; see the
    module note. ``None`` when they are fewer than ``min_support`` or share nothing that narrows the
    cases that ran."""
    if len(unexplained) < min_support:
        return None
    ran = cases[cases["verdict"] != "unsupported"].reset_index(drop=True)
    failing = ran["full_id"].isin(set(unexplained)).to_numpy()
    passing = ran["verdict"].to_numpy() == "pass"
    masks = _literal_masks(ran, [a for a in axes if a in ran.columns])
    # A literal every ran case has (one world size, one optimizer) says nothing: only narrowing ones.
    common = [lit for lit, m in masks.items() if m[failing].all() and not m.all()]
    best: tuple[tuple[int, int, tuple[int, ...]], tuple[AxisValue, ...], np.ndarray] | None = None
    for size in range(1, min(max_literals, len(common)) + 1):
        for combo in itertools.combinations(common, size):
            if len({lit.axis for lit in combo}) < size:
                continue
            match = np.logical_and.reduce([masks[lit] for lit in combo])
            key = (int((match & passing).sum()), size, _sort_key(combo))
            if best is None or key < best[0]:
                best = (key, combo, match)
    if best is None:
        return None
    _, combo, match = best
    # Every case that ran either passed or failed (``unsupported`` ones were dropped): ``match`` counts both.
    return Shared(tuple(sorted(combo, key=lambda lit: _sort_key([lit]))), int(failing.sum()), int(match.sum()))


def attribute(
    frame: pd.DataFrame, *, max_literals: int = MAX_LITERALS, min_support: int = MIN_SUPPORT,
) -> list[Attribution]:
    """One ``Attribution`` per (engine, reference) in the frame, in display order."""
    out: list[Attribution] = []
    if frame.empty:
        return out
    known = expected_failures(frame)
    for engine in ordered("engine", frame["engine"]):
        for reference in ordered("reference", frame["reference"]):
            mine = (frame["engine"] == engine) & (frame["reference"] == reference)
            if not mine.any():
                continue
            group = frame[mine & ~known]  # expected failures carry their own reason: nothing to attribute
            terms, unexplained, n_fail, n_pass = explain(group, max_literals=max_literals, min_support=min_support)
            shared = shared_settings(group, unexplained, max_literals=max_literals, min_support=min_support)
            out.append(Attribution(engine, reference, n_fail, n_pass, terms, unexplained, max_literals,
                                   knob_evidence(group), too_small(group), shared, int((mine & known).sum())))
    return out


def knob_evidence(cases: pd.DataFrame) -> dict[str, int]:
    """Knob -> failing cases of ``cases`` whose knob check found it ignored, most first."""
    if "ignored_knobs" not in cases.columns:
        return {}
    failing = cases[cases["verdict"].isin(FAILING)]
    counts = collections.Counter(k for text in failing["ignored_knobs"].fillna("") for k in str(text).split(",") if k)
    return dict(counts.most_common())


def too_small(cases: pd.DataFrame, axes: Sequence[str] = TERM_AXES) -> bool:
    """Whether the cases that ran number fewer than ``MIN_CASES_PER_VALUE`` per axis value seen among them."""
    ran = cases[cases["verdict"] != "unsupported"]
    values = sum(ran[a].nunique() for a in axes if a in ran.columns and ran[a].nunique() > 1)
    return len(ran) < MIN_CASES_PER_VALUE * values


def attributions_dict(attributions: Sequence[Attribution]) -> list[dict[str, Any]]:
    """The attributions as plain data (``summary.json``'s ``attribution``, a certificate's section)."""
    return [a.to_dict() for a in attributions]


__all__ = ["AxisValue", "Term", "Shared", "Attribution", "explain", "shared_settings", "attribute", "attributions_dict", "knob_evidence", "too_small", "TERM_AXES"]
