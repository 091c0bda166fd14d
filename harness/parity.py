"""Parity: train an engine and a reference on identical data, compare, check the knobs, decide.

On every rank, ``run_case_on_rank`` (the pool's job) builds the case's model, trains the reference
and then the engine for ``case.steps`` steps of SGD with momentum (each rank its own deterministic
batch per step, seeded by ``(seed, step, rank)``), and compares, as this rank sees them:

- ``loss@<step>`` and ``grad_norm@<step>``: the rank's loss and the norm of the gradient its
  optimizer applies (shared gradients once, plus the rank's own rank-local ones);
- ``grad:<name>``: every piece of a gradient this rank's engine holds against the same elements of
  the reference's full gradient, worst over the steps;
- ``param:<name>``: the parameters after the last step (unsharded through the engine's own API).

Each quantity is compared by ``harness.compare`` under the tolerance ``harness.tolerance`` derives
(its docstring says which and why), and ``harness.knobs`` checks that no setting was silently ignored.

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
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.adapters import (
    EngineAdapter,
    EngineFacts,
    EngineTrainee,
    ParamSlice,
    get_engine,
    prepare_inputs,
    rank_local_param_names,
)
from harness.case import CaseConfig, PrecisionSpec
from harness.compare import Observation, compare_observations, derive_budgets, merge_quantities, worst_budgets
from harness.dtypes import dtype_of
from harness.models import ZooModel, build_model, gpu_sleep
from harness.placement import default_shard_size
from harness.pool import PoolOutcome
from harness.rank import RankContext
from harness.knobs import (
    KnobCheck,
    check_backward_prefetch_structure,
    check_offload,
    check_order_changed,
    check_precision,
    check_sharding,
    check_use_orig_params,
)
from harness.records import CaseRecord, QuantityError
from harness.references import TRUTH_SPEC, LocalReference, build_ddp
from harness.tolerance import TolerancePolicy, budget_source
from harness.trace import CommTrace, ops, total_bytes

__all__ = ["FAULTS", "record_from_outcome", "run_case_on_rank"]


#: Fault injections a case can ask for with ``extras=(("fault", name),)``; they prove the pool's
#: watchdog (a rank that skips a collective, hangs in its first forward while rank 0 waits for it,
#: exits, segfaults or raises) and the comparison (rank 1's engine gradient nudged after every backward). ``ignore_option:<keyword>`` (an adapter dropping a
#: setting, for the knob checks) is handled by the adapters.
FAULTS = ("skip_collective_on_rank1", "hang_in_forward_rank1", "exit_rank1", "segfault_rank1", "raise_rank1", "perturb_grad_rank1")


# ---------------------------------------------------------------------------------------------------
# Observations and comparison (pure)


# ---------------------------------------------------------------------------------------------------
# Knob checks (pure, over the trace and engine facts)


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


def _hang_in_forward(module: torch.nn.Module, args: Any) -> None:
    while True:
        time.sleep(1.0)


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
    elif fault == "hang_in_forward_rank1":
        if ctx.rank == 1:
            # Every module's forward on this rank: the hook stays until the watchdog kills the rank.
            torch.nn.modules.module.register_module_forward_pre_hook(_hang_in_forward)
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
