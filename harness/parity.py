"""Parity: train an engine and a reference on identical data, compare, check the knobs, decide.

On every rank, ``run_case_on_rank`` (the pool's job) builds the case's model, trains the reference
and then the engine for ``case.steps`` steps of SGD with momentum (each rank its own deterministic
batch per step, seeded by ``(seed, step, rank)``), and compares, as this rank sees them:

- ``loss@<step>`` and ``grad_norm@<step>``: the rank's loss and the norm of the gradient its
  optimizer applies (shared gradients once, plus the rank's own rank-local ones);
- ``grad:<name>``: every piece of a gradient this rank's engine holds against the same elements of
  the reference's full gradient, worst over the steps;
- ``param:<name>``: the parameters after the last step (unsharded through the engine's own API).

Each quantity is a ``QuantityError`` (max absolute and relative error, the tolerance used, and
``ratio``, the worst element's error over what ``torch.testing.assert_close`` allows). Tolerances
(``budget_source`` decides which; ``TolerancePolicy`` applies them):

- Full precision up to ``ORDER_FREE_WORLD_SIZE`` (2) ranks: torch's defaults for the dtype, nothing
  else. Averaging two ranks' gradients rounds the same whatever the reduction: one addition commutes
  and dividing by 2 is exact, so an fp32 engine matches DDP and the local reference bitwise (every
  fp32 case at 2 gloo ranks measured ratio 0.0).
- Full precision past 2 ranks: torch's defaults, widened per quantity by a budget of
  ``BUDGET_FACTOR`` times the distance between the reference itself and the same run in float64
  (``derive_budgets``, worst over the ranks). With three or more terms the order of a sum changes its
  rounding: DDP divides and then sums in its all-reduce buckets, FSDP1 reduce-scatters between a
  pre- and a post-division, the local reference sums rank after rank, and each bound is
  ``depth * u * sum|g_i|`` (depth ``n - 1`` for a ring or a sequential sum, ``ceil(log2 n)`` for a
  tree). Training then amplifies that rounding from step to step by a factor that belongs to the
  model and the data, not to the world size. Measured on gloo over 5 steps: under torch's defaults
  the transformer's worst ratio over seeds 0-11 is 1.89 at 4 ranks and 1.05 at 8 (seed 0 at 8, ratio
  1.001, is what failed FSDP1 and the built-in engine against DDP), and 0.36 to 0.94 at 3, 6 and 16
  ranks (seed 0); gpt, nested and moe stay below 0.2 at 3 to 8 ranks. A factor of the world size
  alone cannot tell those apart: ``ceil(log2 ws)`` still left 0.95 at 4 ranks, and it already missed
  a gradient planted 1e-5 off (relative) on gpt at 8. The float64 distance measures the
  amplification of the case at hand. Both fp32 runs round the same float64 computation in different
  orders, so by the triangle inequality an engine as accurate as the reference is within about twice
  the reference's drift, and ``BUDGET_FACTOR`` (the same 4 as mixed precision) leaves room for the
  engine to drift more by chance. Measured: worst ratio 0.68 over those transformer runs. Where the
  model does not amplify rounding the budgets stay at or near torch's atol (gpt keeps exactly its
  tolerances), and a gradient planted 1e-5 off still fails every zoo model at 4 and 8 ranks (worst
  ratio 2.4 on gpt to 29). A float64 case keeps the defaults at every world size: float64 is its own
  truth.
- Mixed precision: a budget derived per quantity as ``BUDGET_FACTOR`` times the distance between
  the local reference that emulates the engine's casts and the same run in float64, with the rtol of
  the lowest-precision dtype the case computes or reduces in: a scalar such as a loss can land on a
  lucky rounding in the emulation, so one rounding of the low-precision dtype is always allowed.

A budget is the worst over the ranks (``worst_budgets``): every rank's loss measures the same drift
of the shared parameters from float64, and on one rank the measured run can land next to float64 by
chance (bf16 transformer at 8 ranks: rank 1's emulated loss at step 4 within 0.17 of float64 while
the drift shows as 2.6 on rank 3, so even torch FSDP1 failed that rank's budget). A budget only
widens ``atol``; it never narrows torch's defaults.

Knob checks (``KnobCheck``) make sure no setting is silently ignored: the sharding strategy shows in
which all-gathers and reductions the engine's communication trace holds, the precision in their
dtypes, a prefetch setting must reorder the trace against the same case without it (FSDP2, which
cannot turn backward prefetch off, must show an all-gather issued ahead of the previous unit's
reduction), offload must leave the sharded parameters on CPU and no offload on the device (which is
also where ``init_mode="never"`` must have put them: the other init modes are the harness's own
moves), ``use_orig_params`` decides whether flat parameters are exposed. A check that cannot see
anything in a case (one unit, CPU-only ranks) says ``n/a`` rather than pass.

``record_from_outcome`` (in the parent) turns every rank's answer, or the pool's timeout, crash or
error, into one ``CaseRecord``: the verdict is all-rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from harness.adapters import (
    TRUTH_SPEC,
    EngineAdapter,
    EngineFacts,
    EngineTrainee,
    LocalReference,
    ParamSlice,
    ReferenceRun,
    build_ddp,
    dtype_of,
    get_engine,
    prepare_inputs,
    rank_local_param_names,
)
from harness.case import CaseConfig, PrecisionSpec
from harness.models import ZooModel, build_model, gpu_sleep
from harness.pool import PoolOutcome, RankContext, default_shard_size
from harness.records import CaseRecord, QuantityError
from harness.trace import CommEvent, CommTrace, movable_gathers, ops, signature, total_bytes

__all__ = [
    "BUDGET_FACTOR",
    "BudgetSource",
    "DEFAULT_TOLERANCES",
    "FAULTS",
    "ORDER_FREE_WORLD_SIZE",
    "KnobCheck",
    "Observation",
    "TolerancePolicy",
    "budget_source",
    "check_backward_prefetch_structure",
    "check_offload",
    "check_order_changed",
    "check_precision",
    "check_sharding",
    "check_use_orig_params",
    "combine",
    "compare_observations",
    "compare_tensors",
    "derive_budgets",
    "worst_budgets",
    "merge_quantities",
    "record_from_outcome",
    "run_case_on_rank",
]

#: ``torch.testing.assert_close``'s default ``(rtol, atol)`` per dtype.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}

#: How far from the float64 run an engine may be, in multiples of how far the measured run is (the
#: emulating reference under mixed precision, the reference itself past ``ORDER_FREE_WORLD_SIZE``).
#: The engine rounds at the same places as that run, in another order.
BUDGET_FACTOR = 4.0

#: Up to this many ranks a gradient average rounds the same in any reduction order (one addition
#: commutes, dividing by 1 or 2 is exact): full precision keeps torch's defaults there.
ORDER_FREE_WORLD_SIZE = 2

#: Which run's distance from float64 sets the budgets: none (torch's defaults), the local reference
#: that emulates the engine's casts (mixed precision), or the reference itself (full precision past
#: ``ORDER_FREE_WORLD_SIZE`` ranks).
BudgetSource = Literal["none", "emulation", "reference"]

#: Fault injections a case can ask for with ``extras=(("fault", name),)``; they prove the pool's
#: watchdog (a rank that skips a collective, exits, segfaults or raises) and the comparison (rank 1's
#: engine gradient nudged after every backward). ``ignore_option:<keyword>`` (an adapter dropping a
#: setting, for the knob checks) is handled by the adapters.
FAULTS = ("skip_collective_on_rank1", "exit_rank1", "segfault_rank1", "raise_rank1", "perturb_grad_rank1")

KnobStatus = Literal["ok", "ignored", "n/a"]


# ---------------------------------------------------------------------------------------------------
# Observations and comparison (pure)


@dataclass
class Observation:
    """What one side (engine or reference) showed on this rank."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
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

    @classmethod
    def from_reference(cls, run: ReferenceRun) -> "Observation":
        return cls(
            losses=list(run.losses),
            grad_norms=list(run.grad_norms),
            grads=[[ParamSlice(n, 0, g) for n, g in step.items()] for step in run.grads],
            params=[ParamSlice(n, 0, p) for n, p in run.params.items()],
        )


@dataclass
class Finding:
    """A compared quantity, and where its worst error was."""

    error: QuantityError
    step: int | None = None


@dataclass(frozen=True)
class TolerancePolicy:
    """The tolerance of each quantity: a dtype default, widened by a derived budget where one exists."""

    rtol: float
    atol: float
    #: per quantity name: an absolute budget (mixed precision), used where larger than ``atol``.
    budgets: dict[str, float] = field(default_factory=dict)

    @classmethod
    def for_precision(cls, spec: PrecisionSpec, budgets: dict[str, float] | None = None) -> "TolerancePolicy":
        """torch's defaults for the full dtype; under mixed precision the rtol of the lowest-precision
        dtype the case computes or reduces in (one rounding there) and the derived ``budgets``."""
        rtol, atol = DEFAULT_TOLERANCES.get(dtype_of(spec.full), DEFAULT_TOLERANCES[torch.float32])
        if spec.is_mixed:
            for name in (spec.param, spec.reduce):
                if name is not None:
                    rtol = max(rtol, DEFAULT_TOLERANCES.get(dtype_of(name), (rtol, atol))[0])
        return cls(rtol, atol, dict(budgets or {}))

    def tolerance(self, quantity: str) -> tuple[float, float]:
        """``(atol, rtol)`` for a quantity."""
        return max(self.atol, self.budgets.get(quantity, 0.0)), self.rtol


def compare_tensors(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> QuantityError:
    """The worst disagreement of two tensors, ``torch.testing.assert_close``'s way (in float64)."""
    a = actual.detach().double().reshape(-1).cpu()
    e = expected.detach().double().reshape(-1).cpu()
    if a.shape != e.shape:
        return QuantityError(name, math.inf, math.inf, atol, rtol, False, math.inf)
    if a.numel() == 0:
        return QuantityError(name, 0.0, 0.0, atol, rtol, True, 0.0)
    finite = torch.isfinite(a) & torch.isfinite(e)
    same = a == e  # infinities of one sign agree; NaN never does
    diff = torch.where(same, torch.zeros_like(a), (a - e).abs())
    diff = torch.where(finite | same, diff, torch.full_like(a, math.inf))
    scale = e.abs().nan_to_num(nan=0.0, posinf=0.0)
    rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300), torch.where(diff > 0, math.inf, 0.0))
    allowed = atol + rtol * scale
    ratio = torch.where(diff > 0, diff / allowed, torch.zeros_like(diff))
    worst = float(ratio.max())
    return QuantityError(name, float(diff.max()), float(rel.max()), atol, rtol, worst <= 1.0, worst)


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
            error = QuantityError(name, math.inf, math.inf, atol, rtol, False, math.inf)
        else:
            error = compare_tensors(name, piece.value, ref[piece.start : piece.start + piece.numel], atol, rtol)
        found[name] = _worse(found.get(name), Finding(error, step))
    return found


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


def budget_source(spec: PrecisionSpec, world_size: int) -> BudgetSource:
    """Where a case's budgets come from (the module docstring says why)."""
    if world_size < 1:
        raise ValueError(f"budget_source: world_size={world_size} must be at least 1")
    if spec.is_mixed:
        return "emulation"
    if dtype_of(spec.full) == torch.float64 or world_size <= ORDER_FREE_WORLD_SIZE:
        return "none"
    return "reference"


def derive_budgets(emulated: Observation, truth: Observation, factor: float = BUDGET_FACTOR) -> dict[str, float]:
    """Per quantity: ``factor`` times the largest distance between the measured run (the emulating
    reference, or the full-precision reference itself) and float64."""
    policy = TolerancePolicy(0.0, math.inf)
    return {f.error.name: factor * f.error.max_abs for f in compare_observations(emulated, truth, policy)}


def worst_budgets(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Every rank's derived budgets as one: the largest per quantity (see the module docstring)."""
    merged: dict[str, float] = {}
    for budgets in per_rank:
        for name, budget in budgets.items():
            merged[name] = max(budget, merged.get(name, 0.0))
    return merged


def merge_quantities(per_rank: Sequence[Sequence[dict[str, Any]]]) -> tuple[list[QuantityError], dict[str, dict[str, Any]]]:
    """All ranks' findings into one ``QuantityError`` per quantity (the worst), and where it was."""
    merged: dict[str, QuantityError] = {}
    where: dict[str, dict[str, Any]] = {}
    for rank, findings in enumerate(per_rank):
        for f in findings:
            error = QuantityError(**{k: f[k] for k in QuantityError.__dataclass_fields__})
            current = merged.get(error.name)
            worse = True
            if current is not None:
                error, worse = combine(current, error)
            merged[error.name] = error
            if worse:
                where[error.name] = {"rank": rank, "step": f.get("step")}
    return list(merged.values()), where


# ---------------------------------------------------------------------------------------------------
# Knob checks (pure, over the trace and engine facts)


@dataclass
class KnobCheck:
    """Whether a setting showed its effect: ``ok``, ``ignored`` (fails the case) or ``n/a`` (nothing to see)."""

    knob: str
    status: KnobStatus
    reason: str


_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def check_sharding(strategy: str, events: Sequence[CommEvent], sharded_units: int, replicate_size: int = 1) -> KnobCheck:
    """The strategy in the trace: which phases all-gather, and how gradients are reduced."""
    fwd_ag = len(ops(events, op="all_gather", phase="forward"))
    bwd_ag = len(ops(events, op="all_gather", phase="backward"))
    rs = len(ops(events, op="reduce_scatter", phase="backward"))
    ar = ops(events, op="all_reduce", phase="backward")
    seen = f"forward all-gathers {fwd_ag}, backward all-gathers {bwd_ag}, reduce-scatters {rs}, all-reduces {len(ar)}"
    knob = "sharding_strategy"
    if strategy == "no_shard":
        ok = fwd_ag + bwd_ag == 0 and rs == 0 and len(ar) > 0
        expected = "no all-gather or reduce-scatter, gradients all-reduced"
    elif strategy in ("shard_grad_op", "hybrid_shard_zero2"):
        ok = fwd_ag > 0 and bwd_ag == 0 and rs > 0
        expected = "all-gathers in forward only (parameters kept until backward ends), gradients reduce-scattered"
    else:
        if sharded_units == 0:
            return KnobCheck(knob, "n/a", "no unit besides the root, which is never resharded after forward")
        ok = fwd_ag > 0 and bwd_ag > 0 and rs > 0
        expected = "parameters re-gathered in backward, gradients reduce-scattered"
    if strategy.startswith("hybrid") and replicate_size > 1:
        ok = ok and any(e.group_size == replicate_size for e in ar)
        expected += f", and all-reduced across {replicate_size} replicas"
    if ok:
        return KnobCheck(knob, "ok", seen)
    return KnobCheck(knob, "ignored", f"{strategy}: expected {expected}; saw {seen}")


def check_precision(spec: PrecisionSpec, events: Sequence[CommEvent]) -> KnobCheck:
    """All-gathers carry the compute dtype and gradient reductions the reduce dtype."""
    param = spec.param or spec.full
    reduce = spec.reduce or spec.param or spec.full
    gathers = [e for e in ops(events, op="all_gather") if e.phase in ("forward", "backward") and e.dtype in _FLOAT_DTYPES]
    reductions = [e for e in ops(events, op=("reduce_scatter", "all_reduce"), phase="backward") if e.dtype in _FLOAT_DTYPES]
    if not gathers and not reductions:
        return KnobCheck("precision", "n/a", "no floating-point collective in forward or backward")
    wrong_gather = sorted({e.dtype for e in gathers} - {param})
    wrong_reduce = sorted({e.dtype for e in reductions} - {reduce})
    if wrong_gather or wrong_reduce:
        parts = []
        if wrong_gather:
            parts.append(f"all-gathers in {wrong_gather}, expected {param}")
        if wrong_reduce:
            parts.append(f"gradient reductions in {wrong_reduce}, expected {reduce}")
        return KnobCheck("precision", "ignored", "; ".join(parts))
    return KnobCheck("precision", "ok", f"all-gathers in {param}, reductions in {reduce}")


def check_order_changed(
    knob: str, value: Any, baseline_value: Any, events: Sequence[CommEvent], baseline: Sequence[CommEvent],
    *, phase: str, steps: range,
) -> KnobCheck:
    """A prefetch setting must change the order of ``phase`` against the same case without it."""
    mine = signature(events, phase=phase, steps=steps)
    theirs = signature(baseline, phase=phase, steps=steps)
    gathers = sum(1 for item in mine if item[1] == "all_gather")
    if mine != theirs:
        return KnobCheck(knob, "ok", f"{phase} order differs from {knob}={baseline_value!r} ({gathers} all-gathers)")
    if not movable_gathers(theirs):
        return KnobCheck(knob, "n/a", f"no all-gather in {phase} comes after anything else of its step: nothing to reorder")
    return KnobCheck(
        knob, "ignored",
        f"{knob}={value!r}: the {phase} order of collectives and compute ({gathers} all-gathers) is the same as with {knob}={baseline_value!r}",
    )


def check_backward_prefetch_structure(events: Sequence[CommEvent], steps: range) -> KnobCheck:
    """Without a baseline: a prefetching engine issues some backward all-gather right after another,
    before the reduction of the unit in between."""
    backward = [e for e in ops(events, phase="backward") if e.step in steps]
    gathers = sum(1 for e in backward if e.op == "all_gather")
    if gathers < 2:
        return KnobCheck("backward_prefetch", "n/a", f"{gathers} all-gather(s) in backward: nothing to prefetch")
    if any(a.op == b.op == "all_gather" for a, b in zip(backward, backward[1:])):
        return KnobCheck("backward_prefetch", "ok", "an all-gather is issued before the previous unit's reduction")
    return KnobCheck(
        "backward_prefetch", "ignored", f"every one of {gathers} backward all-gathers waits for the previous unit's reduction"
    )


def check_offload(cpu_offload: bool, param_devices: set[str], device_type: str) -> KnobCheck:
    if device_type == "cpu":
        return KnobCheck("cpu_offload", "n/a", "the ranks compute on CPU: parameters are on CPU either way")
    on_cpu = param_devices == {"cpu"}
    if cpu_offload == on_cpu:
        return KnobCheck("cpu_offload", "ok", f"sharded parameters on {sorted(param_devices)}")
    expected = "CPU" if cpu_offload else device_type
    return KnobCheck("cpu_offload", "ignored", f"cpu_offload={cpu_offload}: sharded parameters on {sorted(param_devices)}, expected {expected}")


def check_use_orig_params(use_orig_params: bool, exposes_flat_params: bool | None) -> KnobCheck:
    if exposes_flat_params is None:
        return KnobCheck("use_orig_params", "n/a", "the engine has no flat parameters")
    if exposes_flat_params != use_orig_params:
        what = "flat parameters" if exposes_flat_params else "original parameters"
        return KnobCheck("use_orig_params", "ok", f"module.parameters() yields {what}")
    what = "flat parameters" if exposes_flat_params else "original parameters"
    return KnobCheck("use_orig_params", "ignored", f"use_orig_params={use_orig_params} but module.parameters() yields {what}")


# ---------------------------------------------------------------------------------------------------
# Training (rank side)


@dataclass(frozen=True)
class ParamInfo:
    """An original parameter as the unwrapped model has it (wrappers rename and flatten)."""

    numel: int
    trainable: bool
    #: belongs to a rank-local module: this rank's own, never reduced.
    rank_local: bool


def _param_table(model: ZooModel) -> dict[str, ParamInfo]:
    local = rank_local_param_names(model)
    return {name: ParamInfo(p.numel(), p.requires_grad, name in local) for name, p in model.named_parameters()}


def _gather_grad_norm(slices: Sequence[ParamSlice], table: dict[str, ParamInfo], ctx: RankContext) -> tuple[float, dict[str, int]]:
    """This rank's gradient norm from every rank's pieces, and the elements no piece covered.

    Shared pieces are counted once however many ranks hold them (replicas, NO_SHARD); rank-local
    ones are this rank's own.
    """
    local_names = {name for name, info in table.items() if info.rank_local}
    mine = [(s.name, s.start, s.numel, float(s.value.double().pow(2).sum())) for s in slices if s.name not in local_names]
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    unique: dict[tuple[str, int, int], float] = {}
    for part in everyone:
        for name, start, numel, sq in part:
            unique.setdefault((name, start, numel), sq)
    total = sum(unique.values())
    local_slices = [s for s in slices if s.name in local_names]
    total += sum(float(s.value.double().pow(2).sum()) for s in local_slices)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, start, numel in unique:
        ranges.setdefault(name, []).append((start, start + numel))
    for s in local_slices:
        ranges.setdefault(s.name, []).append((s.start, s.start + s.numel))
    gaps: dict[str, int] = {}
    for name, info in table.items():
        if not info.trainable:
            continue
        numel = info.numel
        covered, end = 0, 0
        for lo, hi in sorted(ranges.get(name, [])):
            lo = max(lo, end)
            if hi > lo:
                covered += hi - lo
                end = hi
        if covered < numel:
            gaps[name] = numel - covered
    return math.sqrt(total), gaps


def _mark_phase(trace: CommTrace | None, phase: str, step: int) -> None:
    """Tell the trace what the next collectives belong to."""
    if trace is not None:
        trace.phase, trace.step = phase, step


def _paused(trace: CommTrace | None) -> contextlib.AbstractContextManager[None]:
    return trace.paused() if trace is not None else contextlib.nullcontext()


def train(
    trainee: EngineTrainee,
    case: CaseConfig,
    ctx: RankContext,
    steps: int,
    table: dict[str, ParamInfo],
    *,
    trace: CommTrace | None = None,
    perturb: bool = False,
) -> Observation:
    """The shared training loop of engines and DDP: ``steps`` steps, reading gradients after each backward.

    ``table`` describes the model's parameters, taken before wrapping.
    """
    zoo = trainee.zoo
    full = dtype_of(case.precision_spec.full)
    optimizer = torch.optim.SGD(trainee.trainable_parameters(), lr=case.lr, momentum=case.momentum)
    obs = Observation()
    for step in range(steps):
        inputs = prepare_inputs(zoo.get_input(seed=case.seed, step=step, rank=ctx.rank), ctx.device, full)
        _mark_phase(trace, "forward", step)
        output = trainee.module(*inputs)
        loss = zoo.get_loss(inputs, output)
        _mark_phase(trace, "backward", step)
        zoo.run_backward(loss)
        if perturb:
            _perturb_gradient(trainee)
        with _paused(trace):
            slices = trainee.grad_slices()
            norm, gaps = _gather_grad_norm(slices, table, ctx)
        obs.losses.append(float(loss.detach().double()))
        obs.grad_norms.append(norm)
        obs.grads.append(slices)
        for name, missing in gaps.items():
            obs.coverage_gaps[name] = max(missing, obs.coverage_gaps.get(name, 0))
        _mark_phase(trace, "step", step)
        gpu_sleep(zoo.sleeps.before_step_ms, ctx.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with _paused(trace):
        obs.params = trainee.final_params()
    obs.notes.extend(trainee.notes)
    return obs


@torch.no_grad()
def _perturb_gradient(trainee: EngineTrainee) -> None:
    """The ``perturb_grad_rank1`` fault: an engine bug that adds 0.01 to one gradient element."""
    for p in trainee.trainable_parameters():
        grad = p.grad
        if grad is None:
            continue
        # A DTensor's local shard: an op on the DTensor itself would be a collective on one rank.
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel():
            local.view(-1)[0] += 0.01
            return


def _fresh_model(case: CaseConfig, ctx: RankContext) -> tuple[ZooModel, dict[str, ParamInfo]]:
    """The case's model on CPU in its full-precision dtype, and its parameter table (before wrapping)."""
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size)
    model.to(dtype_of(case.precision_spec.full))
    return model, _param_table(model)


def _run_engine(adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, steps: int) -> Observation:
    """Build and train the engine under a communication trace."""
    model, table = _fresh_model(case, ctx)
    trace = CommTrace(before_reduce=lambda: gpu_sleep(model.sleeps.before_reduce_ms, ctx.device))
    with trace:
        trace.watch_modules(model)
        _mark_phase(trace, "setup", 0)
        trainee = adapter.build(case, model, ctx)
        perturb = case.extra.get("fault") == "perturb_grad_rank1" and ctx.rank == 1
        obs = train(trainee, case, ctx, steps, table, trace=trace, perturb=perturb)
    obs.events = list(trace.events)
    obs.facts = trainee.facts()
    return obs


class ReferenceFailed(RuntimeError):
    """The reference itself could not run the case (the verdict is ``error``, and says so)."""


def _run_reference(case: CaseConfig, spec: PrecisionSpec, ctx: RankContext) -> Observation:
    try:
        if case.reference == "ddp":
            model, table = _fresh_model(case, ctx)
            return train(build_ddp(case, model, ctx), case, ctx, case.steps, table)
        return Observation.from_reference(LocalReference(case, spec, ctx.device, ctx.world_size).run(ctx.rank))
    except Exception as exc:
        raise ReferenceFailed(f"the {case.reference!r} reference failed: {type(exc).__name__}: {exc}") from exc


def _sharded_units(model: ZooModel) -> int:
    local = {id(m) for m in model.rank_local_modules()}
    return sum(1 for m in model.wrap_units() if id(m) not in local and any(True for _ in m.parameters()))


def knob_checks(
    adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, spec: PrecisionSpec, engine: Observation
) -> list[KnobCheck]:
    """Every knob of the case against what the engine did; prefetch settings rerun a short baseline."""
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size)
    events = engine.events
    facts = engine.facts if engine.facts is not None else EngineFacts(set(), None)
    if case.sharding_strategy.startswith("hybrid"):
        shard = int(case.extra.get("shard_size", default_shard_size(ctx.world_size, ctx.local_world_size)))
        replicate = ctx.world_size // shard
    else:
        replicate = 1
    checks = [
        check_sharding(case.sharding_strategy, events, _sharded_units(model), replicate),
        check_precision(spec, events),
        check_offload(case.cpu_offload, facts.param_devices, ctx.device_type),
        check_use_orig_params(case.use_orig_params, facts.exposes_flat_params),
    ]
    probe_steps = min(2, case.steps)
    window = range(probe_steps)
    if case.backward_prefetch != "none":
        if adapter.supports_prefetch_baseline(case):
            baseline = _run_engine(adapter, case.replace(backward_prefetch="none"), ctx, probe_steps)
            checks.append(check_order_changed(
                "backward_prefetch", case.backward_prefetch, "none", events, baseline.events, phase="backward", steps=window
            ))
        else:
            checks.append(check_backward_prefetch_structure(events, window))
    if case.forward_prefetch:
        if probe_steps < 2:
            checks.append(KnobCheck("forward_prefetch", "n/a", "one step: the forward order is only known from the second"))
        else:
            baseline = _run_engine(adapter, case.replace(forward_prefetch=False), ctx, probe_steps)
            checks.append(check_order_changed(
                "forward_prefetch", True, False, events, baseline.events, phase="forward", steps=window
            ))
    return checks


def _same(a: Observation, b: Observation) -> str:
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


def _inject_fault(case: CaseConfig, ctx: RankContext) -> None:
    fault = str(case.extra.get("fault", ""))
    if not fault or fault.startswith("ignore_option:"):
        return
    if fault not in FAULTS:
        raise ValueError(f"extras fault={fault!r} is not one of {list(FAULTS)} or 'ignore_option:<keyword>'")
    if fault == "perturb_grad_rank1":
        return  # applied inside the engine's training loop
    if fault == "skip_collective_on_rank1":
        if ctx.rank != 1:
            dist.all_reduce(torch.zeros(1, device=ctx.device))
    elif ctx.rank == 1:
        print(f"injected fault {fault} on rank 1", file=sys.stderr, flush=True)
        if fault == "exit_rank1":
            os._exit(3)
        if fault == "segfault_rank1":
            os.kill(os.getpid(), signal.SIGSEGV)
        raise RuntimeError(f"injected fault {fault}")


def run_case_on_rank(ctx: RankContext, case: CaseConfig) -> dict[str, Any]:
    """The pool's job: the whole case as this rank sees it, as plain data (see ``record_from_outcome``)."""
    if case.world_size != ctx.world_size:
        return {"status": "unsupported", "reason": f"case world_size={case.world_size} but the ranks are {ctx.world_size}"}
    adapter = get_engine(case.engine)
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size)
    reason = adapter.unsupported_reason(case, model, ctx)
    if reason:
        return {"status": "unsupported", "reason": reason}
    _inject_fault(case, ctx)
    spec = adapter.effective_precision(case, model)

    t0 = time.perf_counter()
    reference = _run_reference(case, spec, ctx)
    source = budget_source(spec, ctx.world_size)
    budgets: dict[str, float] = {}
    if source != "none":
        # The local reference already emulates the casts; DDP computes in full precision.
        measured = reference
        if source == "emulation" and case.reference != "local":
            measured = _run_reference(case.replace(reference="local"), spec, ctx)
        truth = Observation.from_reference(LocalReference(case, TRUTH_SPEC, ctx.device, ctx.world_size).run(ctx.rank))
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, derive_budgets(measured, truth))
        budgets = worst_budgets(everyone)
    reference_s = time.perf_counter() - t0

    if ctx.device_type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    engine = _run_engine(adapter, case, ctx, case.steps)
    engine_s = time.perf_counter() - t0
    peak = int(torch.cuda.max_memory_allocated(ctx.device)) if ctx.device_type == "cuda" else 0

    policy = TolerancePolicy.for_precision(spec, budgets)
    findings = compare_observations(engine, reference, policy)
    checks = knob_checks(adapter, case, ctx, spec, engine)

    deterministic: bool | None = None
    nondeterminism = ""
    if case.check_determinism:
        nondeterminism = _same(engine, _run_engine(adapter, case, ctx, case.steps))
        deterministic = not nondeterminism

    training = [e for e in engine.events if e.phase in ("forward", "backward", "step")]
    return {
        "status": "ok",
        "reason": "",
        "findings": [{**asdict(f.error), "step": f.step} for f in findings],
        "knobs": [asdict(c) for c in checks],
        "deterministic": deterministic,
        "nondeterminism": nondeterminism,
        "engine_s": engine_s,
        "reference_s": reference_s,
        "peak_mem_bytes": peak,
        "bytes_all_gathered": total_bytes(training, "all_gather"),
        "bytes_reduce_scattered": total_bytes(training, "reduce_scatter"),
        "collectives": {
            kind: len(ops(training, op=kind)) for kind in ("all_gather", "reduce_scatter", "all_reduce")
        },
        "mixed_precision_budgets": source == "emulation",
        "budget_source": source,
        "notes": engine.notes,
        "curves": {
            "loss": {"engine": engine.losses, "reference": reference.losses},
            "grad_norm": {"engine": engine.grad_norms, "reference": reference.grad_norms},
        },
    }


# ---------------------------------------------------------------------------------------------------
# The verdict (parent side, pure)


def _failure_line(error: QuantityError, where: dict[str, Any]) -> str:
    at = []
    if where.get("step") is not None:
        at.append(f"step {where['step']}")
    at.append(f"rank {where.get('rank', '?')}")
    if math.isinf(error.max_abs) and math.isinf(error.ratio):
        return f"{error.name}: missing or uncovered in the engine's result ({', '.join(at)})"
    return (
        f"{error.name}: max_abs {error.max_abs:.3g} exceeds atol {error.atol:.3g} + rtol {error.rtol:.3g}*|ref| "
        f"(ratio {error.ratio:.3g}) at {' on '.join(at)}"
    )


def record_from_outcome(case: CaseConfig, outcome: PoolOutcome) -> CaseRecord:
    """One all-rank ``CaseRecord`` from what the pool got back for ``run_case_on_rank``."""
    base: dict[str, Any] = {"case": case.to_dict(), "case_id": case.case_id, "wall_s": outcome.wall_s}
    if outcome.status != "ok":
        detail: dict[str, Any] = {}
        if outcome.errors:
            detail["tracebacks"] = {str(r): e.traceback for r, e in outcome.errors.items()}
        if outcome.stacks:
            detail["stacks"] = {str(r): s for r, s in outcome.stacks.items()}
        if outcome.exit_codes:
            detail["exit_codes"] = {str(r): c for r, c in outcome.exit_codes.items()}
        if outcome.stderr_tails:
            detail["stderr_tails"] = {str(r): t for r, t in outcome.stderr_tails.items()}
        return CaseRecord(verdict=outcome.status, reason=outcome.reason, detail=detail, **base)

    values: list[dict[str, Any]] = list(outcome.values)
    unsupported = [v for v in values if v.get("status") == "unsupported"]
    if unsupported:
        return CaseRecord(verdict="unsupported", reason=unsupported[0]["reason"], **base)

    errors, where = merge_quantities([v["findings"] for v in values])
    knobs: dict[str, dict[str, Any]] = {}
    for v in values:
        for check in v["knobs"]:
            current = knobs.get(check["knob"])
            rank_order = {"ignored": 2, "ok": 1, "n/a": 0}
            if current is None or rank_order[check["status"]] > rank_order[current["status"]]:
                knobs[check["knob"]] = check
    determinism = [v["deterministic"] for v in values]
    deterministic = None if any(d is None for d in determinism) else all(determinism)

    reasons: list[str] = []
    failing = sorted((e for e in errors if not e.passed), key=lambda e: -e.ratio)
    if failing:
        reasons.append(_failure_line(failing[0], where[failing[0].name]))
        if len(failing) > 1:
            reasons[-1] += f" (+{len(failing) - 1} more)"
    for check in knobs.values():
        if check["status"] == "ignored":
            reasons.append(f"knob {check['knob']} ignored: {check['reason']}")
    if deterministic is False:
        nondet = next(v["nondeterminism"] for v in values if v["nondeterminism"])
        reasons.append(f"not deterministic: {nondet}")
    if not errors:
        reasons.append("nothing was compared")
    curves = None
    if all("curves" in v for v in values):
        curves = {q: {side: [list(v["curves"][q][side]) for v in values] for side in ("engine", "reference")}
                  for q in ("loss", "grad_norm")}

    return CaseRecord(
        verdict="fail" if reasons else "pass",
        reason="; ".join(reasons),
        errors=errors,
        deterministic=deterministic,
        peak_mem_bytes=max(v["peak_mem_bytes"] for v in values),
        bytes_all_gathered=max(v["bytes_all_gathered"] for v in values),
        bytes_reduce_scattered=max(v["bytes_reduce_scattered"] for v in values),
        detail={
            "knobs": list(knobs.values()),
            "worst_at": {name: where[name] for name in (e.name for e in failing[:10])},
            "engine_s": [v["engine_s"] for v in values],
            "reference_s": [v["reference_s"] for v in values],
            "collectives": values[0]["collectives"],
            "mixed_precision_budgets": values[0]["mixed_precision_budgets"],
            "budget_source": values[0].get("budget_source", "none"),
            "notes": sorted({n for v in values for n in v["notes"]}),
        },
        curves=curves,
        **base,
    )
