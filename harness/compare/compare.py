"""Observations and their comparison: what one side (engine or reference) showed on a rank, and how
far the engine is from the reference per quantity (pure functions over tensors; no processes).

``compare_observations`` gives a ``Finding`` per quantity (``loss@<step>``, ``grad_norm@<step>``,
``grad:<name>``, ``param:<name>``), worst over the steps, under a ``harness.compare.tolerance.TolerancePolicy``;
``derive_budgets`` measures a run's distance to float64 (the budgets the policy widens ``atol`` by),
``derive_budgets_over`` the worst of several runs' (the emulation summed in each of its orders);
``merge_quantities`` folds every rank's findings into one per quantity; ``measure_drift`` and
``merge_drifts`` measure, under mixed precision, how far the emulating reference is from the runs a
cast-dropping engine would compute (``harness.compare.tolerance.mixed_precision_budgets`` reads them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.cases.records import QuantityError
from harness.compare.tolerance import BUDGET_FACTOR, TolerancePolicy
from harness.compare.trace import CommEvent
from harness.engines.adapters import EngineFacts, ParamSlice
from harness.engines.references import ReferenceRun

__all__ = [
    "Drift",
    "Finding",
    "Observation",
    "assert_tensors_match",
    "combine",
    "compare_observations",
    "compare_tensors",
    "derive_budgets",
    "derive_budgets_over",
    "error_text",
    "first_difference",
    "magnitudes",
    "measure_drift",
    "merge_drifts",
    "merge_quantities",
    "worst_budgets",
]


@dataclass
class Observation:
    """What one side (engine or reference) showed on this rank."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    #: per step, with ``clip_grad``: the total norm the side's ``clip_grad_norm_`` returned (before clipping).
    clip_norms: list[float] = field(default_factory=list)
    #: per step: the gradient pieces this side holds (a reference holds every parameter in full).
    grads: list[list[ParamSlice]] = field(default_factory=list)
    #: the parameters at the end, pieces or full.
    params: list[ParamSlice] = field(default_factory=list)
    #: elements of trainable parameters no rank's engine held a gradient for, by name (worst step).
    coverage_gaps: dict[str, int] = field(default_factory=dict)
    events: list[CommEvent] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: what the engine did with its parameters (engines only).
    facts: EngineFacts | None = None
    #: how often each stress delay fired (``harness.compare.stress``; engines of a stressed case only).
    stress_points: dict[str, int] = field(default_factory=dict)
    #: host seconds spent reading what this side holds (``harness.compare.training.observing``): timing only,
    #: never compared.
    observe_s: float = 0.0

    @classmethod
    def from_reference(cls, run: ReferenceRun) -> "Observation":
        return cls(
            losses=list(run.losses),
            grad_norms=list(run.grad_norms),
            clip_norms=list(run.clip_norms),
            grads=[[ParamSlice(n, 0, g) for n, g in step.items()] for step in run.grads],
            params=[ParamSlice(n, 0, p) for n, p in run.params.items()],
        )


@dataclass
class Finding:
    """A compared quantity, and where its worst error was."""

    error: QuantityError
    step: int | None = None


def compare_tensors(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> QuantityError:
    """The worst disagreement of two tensors, ``torch.testing.assert_close``'s way (in float64)."""
    a = actual.detach().double().reshape(-1).cpu()
    e = expected.detach().double().reshape(-1).cpu()
    if a.shape != e.shape:
        return QuantityError(name, math.inf, math.inf, atol, rtol, False, math.inf)
    if a.numel() == 0 or torch.equal(a, e):
        # Equal elements (NaN never is) give zero everywhere below; most quantities of an honest engine are
        # bitwise its reference's (fp32 and the casts' emulation at 2 ranks), so this is the common case.
        return QuantityError(name, 0.0, 0.0, atol, rtol, True, 0.0)
    # Infinities of one sign agree (their difference, NaN, becomes 0); NaN never does, and any other
    # non-finite difference is infinite. In place, as few passes as the definition allows: past 2 ranks
    # most quantities differ, and a nightly compares millions of them.
    diff = (a - e).abs_().nan_to_num_(nan=math.inf, posinf=math.inf).masked_fill_(a == e, 0.0)
    scale = e.abs().nan_to_num_(nan=0.0, posinf=0.0)
    rel = torch.where(scale == 0, torch.where(diff > 0, math.inf, 0.0), diff / scale.clamp_min(1e-300))
    ratio = (diff / (atol + rtol * scale)).masked_fill_(diff == 0, 0.0)
    worst = float(ratio.max())
    return QuantityError(name, float(diff.max()), float(rel.max()), atol, rtol, worst <= 1.0, worst)


def error_text(error: QuantityError) -> str:
    """One failing quantity in words: how far past its tolerance it is, or that it is missing."""
    if math.isinf(error.max_abs) and math.isinf(error.ratio):
        return f"{error.name}: missing or uncovered in the engine's result"
    return (
        f"{error.name}: max_abs {error.max_abs:.3g} exceeds atol {error.atol:.3g} + rtol {error.rtol:.3g}*|ref| "
        f"(ratio {error.ratio:.3g})"
    )


def assert_tensors_match(name: str, actual: torch.Tensor, expected: torch.Tensor, policy: TolerancePolicy, context: str = "") -> None:
    """Raise ``AssertionError`` (``context``: what was compared) unless ``actual`` matches ``expected``
    under ``policy``: the checks that compare tensors directly decide as the generated cases do. Shape,
    dtype and device must agree exactly, as ``torch.testing.assert_close`` requires by default."""
    prefix = f"{context}: " if context else ""
    got, want = (actual.shape, actual.dtype, actual.device), (expected.shape, expected.dtype, expected.device)
    if got != want:
        raise AssertionError(f"{prefix}{name}: got {tuple(got[0])} {got[1]} on {got[2]}, expected {tuple(want[0])} {want[1]} on {want[2]}")
    error = compare_tensors(name, actual, expected, *policy.tolerance(name))
    if not error.passed:
        raise AssertionError(prefix + error_text(error))


def combine(a: QuantityError, b: QuantityError) -> tuple[QuantityError, bool]:
    """Two measurements of one quantity (steps, ranks) as one: the worse by ratio, with the larger
    ``max_abs`` and ``max_rel`` of both, passed only if both passed; and whether ``b`` was the worse."""
    b_worse = b.ratio > a.ratio
    worst = b if b_worse else a
    merged = replace(worst, max_abs=max(a.max_abs, b.max_abs), max_rel=max(a.max_rel, b.max_rel), passed=a.passed and b.passed)
    return merged, b_worse


def _worse(a: Finding | None, b: Finding) -> Finding:
    if a is None:
        return b
    error, b_worse = combine(a.error, b.error)
    return Finding(error, b.step if b_worse else a.step)


def _reference_tensors(slices: Sequence[ParamSlice]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for s in slices:
        if s.start != 0 and s.name not in out:
            raise ValueError(f"reference slice {s.name}[{s.start}:] is not a full parameter")
        out[s.name] = s.value
    return out


def _compare_slices(
    prefix: str, actual: Sequence[ParamSlice], expected: dict[str, torch.Tensor], policy: TolerancePolicy, step: int | None
) -> dict[str, Finding]:
    found: dict[str, Finding] = {}
    for piece in actual:
        name = f"{prefix}:{piece.name}"
        atol, rtol = policy.tolerance(name)
        ref = expected.get(piece.name)
        if ref is None or piece.start + piece.numel > ref.numel():
            found[name] = _worse(found.get(name), Finding(QuantityError(name, math.inf, math.inf, atol, rtol, False, math.inf), step))
            continue
        held = policy.null_gradients.get(piece.name) if prefix == "param" else None
        for quantity, value, want, tol in _split_held(name, piece, ref.reshape(-1), held, (atol, rtol)):
            found[quantity] = _worse(found.get(quantity), Finding(compare_tensors(quantity, value, want, *tol), step))
    return found


def _split_held(
    name: str, piece: ParamSlice, ref: torch.Tensor, held: tuple[int, int, float] | None, tol: tuple[float, float]
) -> list[tuple[str, torch.Tensor, torch.Tensor, tuple[float, float]]]:
    """``piece`` against its part of ``ref``: whole, or, where the policy holds elements ``[a, b)`` of
    the parameter to a bound of their own, as the rest (under ``tol``) and those elements (under the
    bound, as ``name[a:b]``)."""
    lo, hi = piece.start, piece.start + piece.numel
    value = piece.value.reshape(-1)
    if held is None or held[1] <= lo or held[0] >= hi:
        return [(name, value, ref[lo:hi], tol)]
    a, b = max(held[0], lo), min(held[1], hi)
    inside = torch.arange(lo, hi, device=value.device)
    mask = (inside >= a) & (inside < b)
    parts = [(f"{name}[{held[0]}:{held[1]}]", value[mask], ref[lo:hi][mask.to(ref.device)], (held[2], 0.0))]
    if not bool(mask.all()):
        parts.append((name, value[~mask], ref[lo:hi][(~mask).to(ref.device)], tol))
    return parts


def compare_observations(engine: Observation, reference: Observation, policy: TolerancePolicy) -> list[Finding]:
    """Every quantity of the engine against the reference (this rank's view), worst over steps."""
    findings: dict[str, Finding] = {}

    def scalar(name: str, actual: float, expected: float, step: int) -> None:
        atol, rtol = policy.tolerance(name)
        findings[name] = Finding(compare_tensors(name, torch.tensor(actual), torch.tensor(expected), atol, rtol), step)

    for step, (a, e) in enumerate(zip(engine.losses, reference.losses)):
        scalar(f"loss@{step}", a, e, step)
    for step, (a, e) in enumerate(zip(engine.grad_norms, reference.grad_norms)):
        scalar(f"grad_norm@{step}", a, e, step)
    for step, (a, e) in enumerate(zip(engine.clip_norms, reference.clip_norms)):
        scalar(f"clip_norm@{step}", a, e, step)
    if len(engine.clip_norms) != len(reference.clip_norms):
        atol, rtol = policy.tolerance("clip_norm")
        findings["clip_norm"] = Finding(QuantityError("clip_norm", math.inf, math.inf, atol, rtol, False, math.inf), None)
    grad_findings: dict[str, Finding] = {}
    for step, (a_slices, e_slices) in enumerate(zip(engine.grads, reference.grads)):
        for name, finding in _compare_slices("grad", a_slices, _reference_tensors(e_slices), policy, step).items():
            grad_findings[name] = _worse(grad_findings.get(name), finding)
    findings.update(dict(sorted(grad_findings.items())))
    param_findings = _compare_slices("param", engine.params, _reference_tensors(reference.params), policy, None)
    findings.update(dict(sorted(param_findings.items())))
    for name, missing in sorted(engine.coverage_gaps.items()):
        qname = f"grad:{name}"
        atol, rtol = policy.tolerance(qname)
        gap = Finding(QuantityError(qname, math.inf, math.inf, atol, rtol, False, math.inf), None)
        findings[qname] = _worse(findings.get(qname), gap)
    return list(findings.values())


def derive_budgets(emulated: Observation, truth: Observation, factor: float = BUDGET_FACTOR) -> dict[str, float]:
    """Per quantity: ``factor`` times the largest distance between the measured run (the emulating
    reference, or the full-precision reference itself) and float64."""
    policy = TolerancePolicy(0.0, math.inf)
    return {f.error.name: factor * f.error.max_abs for f in compare_observations(emulated, truth, policy)}


def derive_budgets_over(runs: Sequence[Observation], truth: Observation, factor: float = BUDGET_FACTOR) -> dict[str, float]:
    """``derive_budgets`` of the run farthest from float64 per quantity: ``runs`` are the measured run summed
    in each of its orders (``harness.compare.tolerance.emulation_orders``), any of which an honest engine's
    backend may take."""
    if not runs:
        raise ValueError("derive_budgets_over: no run to measure")
    return worst_budgets([derive_budgets(run, truth, factor) for run in runs])


def distances(a: Observation, b: Observation) -> dict[str, float]:
    """Per quantity, the largest absolute difference of two runs (worst over the steps)."""
    return derive_budgets(a, b, factor=1.0)


def magnitudes(obs: Observation) -> dict[str, float]:
    """Per quantity, the largest magnitude a run shows (what torch's rtol scales with)."""
    out: dict[str, float] = {}
    for step, loss in enumerate(obs.losses):
        out[f"loss@{step}"] = abs(loss)
    for step, norm in enumerate(obs.grad_norms):
        out[f"grad_norm@{step}"] = abs(norm)
    for step, norm in enumerate(obs.clip_norms):
        out[f"clip_norm@{step}"] = abs(norm)
    for slices, prefix in [(s, "grad") for s in obs.grads] + [(obs.params, "param")]:
        for piece in slices:
            name = f"{prefix}:{piece.name}"
            value = float(piece.value.detach().double().abs().max()) if piece.numel else 0.0
            out[name] = max(value, out.get(name, 0.0))
    return out


@dataclass
class Drift:
    """Under mixed precision, how far the emulating reference is on one rank (or, merged, on any)."""

    #: per reference (``fp64``, ``no_param`` ...) and quantity: the distance from the emulation.
    distances: dict[str, dict[str, float]]
    #: per quantity: the emulation's magnitude.
    scales: dict[str, float]


def measure_drift(emulated: Observation, others: dict[str, Observation]) -> Drift:
    """This rank's ``Drift``: ``emulated`` against each run of ``others``."""
    return Drift({name: distances(emulated, other) for name, other in others.items()}, magnitudes(emulated))


def merge_drifts(per_rank: Sequence[Drift]) -> Drift:
    """Every rank's drift as one, the largest per reference and quantity: on the rank where a dropped
    cast moves a quantity most, the engine that drops it is off by the full distance."""
    merged = Drift({}, {})
    for drift in per_rank:
        for name, per in drift.distances.items():
            target = merged.distances.setdefault(name, {})
            for q, d in per.items():
                target[q] = max(d, target.get(q, 0.0))
        for q, d in drift.scales.items():
            merged.scales[q] = max(d, merged.scales.get(q, 0.0))
    return merged


def worst_budgets(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Every rank's derived budgets as one: the largest per quantity (see the module docstring)."""
    merged: dict[str, float] = {}
    for budgets in per_rank:
        for name, budget in budgets.items():
            merged[name] = max(budget, merged.get(name, 0.0))
    return merged


def merge_quantities(per_rank: Sequence[Sequence[Finding]]) -> tuple[list[QuantityError], dict[str, dict[str, Any]]]:
    """All ranks' findings into one ``QuantityError`` per quantity (the worst), and where it was."""
    merged: dict[str, QuantityError] = {}
    where: dict[str, dict[str, Any]] = {}
    for rank, findings in enumerate(per_rank):
        for f in findings:
            error = f.error
            current = merged.get(error.name)
            worse = True
            if current is not None:
                error, worse = combine(current, error)
            merged[error.name] = error
            if worse:
                where[error.name] = {"rank": rank, "step": f.step}
    return list(merged.values()), where


def first_difference(a: Observation, b: Observation) -> str:
    """Empty when two engine runs are bitwise identical, else the first difference."""
    if a.losses != b.losses:
        return "losses differ"
    if [[(p.name, p.start) for p in g] for g in a.grads] != [[(p.name, p.start) for p in g] for g in b.grads]:
        return "the gradient pieces differ"
    if [(p.name, p.start) for p in a.params] != [(p.name, p.start) for p in b.params]:
        return "the parameter pieces differ"
    for step, (x, y) in enumerate(zip(a.grads, b.grads)):
        for p, q in zip(x, y):
            if p.name != q.name or not torch.equal(p.value, q.value):
                return f"grad:{p.name} differs at step {step}"
    for p, q in zip(a.params, b.params):
        if p.name != q.name or not torch.equal(p.value, q.value):
            return f"param:{p.name} differs"
    return ""
