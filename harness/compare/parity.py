"""Parity: train an engine and a reference on identical data, compare, check the knobs, decide.

On every rank, ``run_case_on_rank`` (the pool's job) builds the case's model, trains the reference
and then the engine for ``case.steps`` steps of the case's optimizer (each rank its own deterministic
batch per step, seeded by ``(seed, step, rank)``), and compares, as this rank sees them:

- ``loss@<step>`` and ``grad_norm@<step>``: the rank's loss and the norm of the gradient its
  optimizer applies (shared gradients once, plus the rank's own rank-local ones);
- ``grad:<name>``: every piece of a gradient this rank's engine holds against the same elements of
  the reference's full gradient, worst over the steps;
- ``param:<name>``: the parameters after the last step (unsharded through the engine's own API).

Each quantity is compared by ``harness.compare.compare`` under the tolerance ``harness.compare.tolerance`` derives
(its docstring says which and why), and ``harness.compare.knobs`` checks that no setting was silently ignored.

``record_from_outcome`` (in the parent) turns every rank's answer, or the pool's timeout, crash or
error, into one ``CaseRecord``: the verdict is all-rank.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from harness.cases.case import CLIP_MAX_NORM, CaseConfig, PrecisionSpec, is_hybrid
from harness.cases.models import ZooModel, build_model, gpu_sleep
from harness.cases.records import CaseRecord, QuantityError
from harness.compare.compare import (
    Finding,
    Observation,
    compare_observations,
    derive_budgets_over,
    error_text,
    first_difference,
    measure_drift,
    merge_drifts,
    merge_quantities,
    worst_budgets,
)
from harness.compare.compiling import backend_for, check_compiled, compile_module, compiled_counts
from harness.compare.knobs import (
    KnobCheck,
    check_backward_prefetch_structure,
    check_grad_accum,
    check_offload,
    check_offload_placement,
    check_order_changed,
    check_precision,
    check_sharding,
    check_use_orig_params,
)
from harness.compare.offload_probe import probe_offload_placement
from harness.compare.phases import BEFORE_JOB, PhaseClock, busiest, handoff_s
from harness.compare.prefetch_baseline import baseline_events, baseline_steps, keep_own_run
from harness.compare.reference_cache import CachedReference, ReferenceCache, cacheable, consensus, reference_key
from harness.compare.resume import run_resumed
from harness.compare.stress import Stress
from harness.compare.stress import unsupported_reason as stress_unsupported_reason
from harness.compare.tolerance import (BudgetSource, TolerancePolicy, adam_drift_bound, budget_source, emulation_orders,
                                       mixed_precision_budgets)
from harness.compare.trace import CommTrace, ops, total_bytes
from harness.compare.training import ACCUMULATE, fresh_model, mark_phase, train
from harness.engines.adapters import EngineAdapter, EngineFacts, has_float_buffers
from harness.engines.checkpoint import CHECKPOINT_FAULTS, unsupported_checkpoint
from harness.engines.optim import ADAMW_BETAS, ADAMW_WEIGHT_DECAY, adam_lr
from harness.engines.owned_step import findings
from harness.engines.references import TRUTH_SPEC, LocalReference, RankOrder, build_ddp, cast_ablations
from harness.engines.registry import resolve
from harness.ranks.placement import hybrid_group_ranks, hybrid_shard_size
from harness.ranks.pool import PoolOutcome
from harness.ranks.rank import RankContext
from harness.ranks.stacks import portable_paths

__all__ = ["FAULTS", "RankResult", "knob_checks_off", "non_finite_line", "record_from_outcome", "run_case_on_rank",
           "smoke_refusal", "unsupported_here"]

#: Fault injections a case can ask for with ``extras=(("fault", name),)``; they prove the pool's
#: watchdog (a rank that skips a collective, hangs in its first forward while rank 0 waits for it,
#: exits, segfaults or raises), the comparison (rank 1's engine gradient nudged after every backward),
#: and the resume check (``harness.engines.checkpoint``: the optimizer state dropped or mixed up on load).
#: ``ignore_option:<keyword>`` (an adapter dropping a setting, for the knob checks) is handled by the adapters.
FAULTS = ("skip_collective_on_rank1", "hang_in_forward_rank1", "exit_rank1", "segfault_rank1", "raise_rank1",
          "perturb_grad_rank1", *CHECKPOINT_FAULTS)


# ---------------------------------------------------------------------------------------------------
# Training (rank side; the loop itself is ``harness.compare.training``)


def _run_engine(adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, steps: int,
                clock: PhaseClock | None = None) -> Observation:
    """Build and train the engine under a communication trace; a checkpoint case saves and resumes
    half-way (``harness.compare.resume``) when it trains past its checkpoint step; a stressed case delays the
    compute stream at the race points (``harness.compare.stress``). ``clock`` laps ``build`` once the engine
    is built, where it is built once (a resumed run's builds are its steps')."""
    model, table = fresh_model(case, ctx)
    stress = Stress(ctx.device) if case.stress == "delay" else None
    trace = CommTrace(before_reduce=lambda: gpu_sleep(model.sleeps.before_reduce_ms, ctx.device),
                      around=stress.on_collective if stress is not None else None)
    perturb = case.extra.get("fault") == "perturb_grad_rank1" and ctx.rank == 1
    try:
        with trace:
            if case.checkpoint != "none" and steps > case.checkpoint_step:
                obs, trainee = run_resumed(adapter, case, ctx, steps, trace, perturb)
            else:
                trace.watch_modules(model)
                if stress is not None:
                    stress.watch_model(model)
                mark_phase(trace, "setup", 0)
                trainee = adapter.build(case, model, ctx)
                if stress is not None:
                    stress.watch_parameters(trainee.trainable_parameters())
                    stress.watch_no_sync(trainee.module)
                if case.compile == "compiled":
                    trainee.module = compile_module(trainee.module, ctx.device_type)
                if clock is not None:  # host time: kernels the build queued on CUDA finish in the steps
                    clock.lap("build")
                obs = train(trainee, case, ctx, steps, table, trace=trace, perturb=perturb, stress=stress)
                if case.compile == "compiled":
                    counts = compiled_counts()
                    check_compiled(counts)
                    obs.notes.append(counts.note(backend_for(ctx.device_type)))
    finally:
        if stress is not None:
            stress.remove()
    obs.events = list(trace.events)
    obs.facts = trainee.facts()
    obs.stress_points = dict(stress.counts) if stress is not None else {}
    return obs


class ReferenceFailed(RuntimeError):
    """The reference itself could not run the case (the verdict is ``error``, and says so)."""


def _run_reference(case: CaseConfig, spec: PrecisionSpec, ctx: RankContext) -> Observation:
    try:
        if case.reference == "ddp":
            model, table = fresh_model(case, ctx)
            obs = train(build_ddp(case, model, ctx), case, ctx, case.steps, table)
        else:
            obs = _local_observation(case, spec, ctx)
    except Exception as exc:
        raise ReferenceFailed(f"the {case.reference!r} reference failed: {type(exc).__name__}: {exc}") from exc
    unclipped = [step for step, norm in enumerate(obs.clip_norms) if not norm > CLIP_MAX_NORM]
    if unclipped:
        raise ReferenceFailed(
            f"clip_grad='norm': the {case.reference!r} reference's total norm is at most CLIP_MAX_NORM={CLIP_MAX_NORM} "
            f"at steps {unclipped}, so clipping changes nothing there; lower harness.cases.case.CLIP_MAX_NORM"
        )
    return obs


def _sharded_units(model: ZooModel) -> int:
    local = {id(m) for m in model.rank_local_modules()}
    return sum(1 for m in model.wrap_units() if id(m) not in local and any(True for _ in m.parameters()))


def knob_checks(
    adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, spec: PrecisionSpec, engine: Observation, model: ZooModel
) -> list[KnobCheck]:
    """Every knob of the case against what the engine did (``model``: the case's model as built, untrained, whose
    units the sharding check counts); prefetch settings rerun a short baseline, CPU offload a one-step
    placement probe (``harness.compare.offload_probe``)."""
    events = engine.events
    facts = engine.facts if engine.facts is not None else EngineFacts(set(), None)
    hybrid = None
    if is_hybrid(case.sharding_strategy):
        shard_size = hybrid_shard_size(case.extra, ctx.world_size, ctx.local_world_size)
        hybrid = hybrid_group_ranks(ctx.rank, ctx.world_size, shard_size)
    # A no_sync micro-batch's all-gathers are its forward's and backward's: FSDP1 keeps SHARD_GRAD_OP's
    # parameters unsharded through no_sync, so the last micro-batch may gather nothing.
    gathers = [replace(e, phase=e.phase.removeprefix(ACCUMULATE)) if e.op == "all_gather" else e for e in events]
    checks = [
        check_sharding(case.sharding_strategy, gathers, _sharded_units(model), hybrid, ctx.world_size),
        check_precision(spec, events),
        check_offload(case.cpu_offload, facts.param_devices, ctx.device_type),
        check_use_orig_params(case.use_orig_params, facts.exposes_flat_params),
    ]
    if case.grad_accum != "none":
        checks.append(check_grad_accum(case.grad_accum, events, ctx.world_size))
    if case.cpu_offload:
        # A fresh build's step, after the compared run ([Note: a throwaway step, not the compared run]).
        probe = probe_offload_placement(adapter, case, ctx)
        checks.append(check_offload_placement(probe.log, probe.compute_device, probe.not_observed))
    probe_steps = baseline_steps(case)
    window = range(probe_steps)
    if case.backward_prefetch != "none":
        if adapter.supports_prefetch_baseline(case):
            baseline = baseline_events(_run_engine, adapter, case.replace(backward_prefetch="none"), ctx, probe_steps)
            checks.append(check_order_changed(
                "backward_prefetch", case.backward_prefetch, "none", events, baseline, phase="backward", steps=window
            ))
        else:
            checks.append(check_backward_prefetch_structure(events, window))
    if case.forward_prefetch:
        if probe_steps < 2:
            checks.append(KnobCheck("forward_prefetch", "n/a", "one step: the forward order is only known from the second"))
        else:
            baseline = baseline_events(_run_engine, adapter, case.replace(forward_prefetch=False), ctx, probe_steps)
            checks.append(check_order_changed(
                "forward_prefetch", True, False, events, baseline, phase="forward", steps=window
            ))
    return checks


def _hang_in_forward(module: torch.nn.Module, args: Any) -> None:
    while True:
        time.sleep(1.0)


def _inject_fault(case: CaseConfig, ctx: RankContext) -> None:
    fault = str(case.extra.get("fault", ""))
    if not fault or fault.startswith("ignore_option:"):
        return
    if fault not in FAULTS:
        raise ValueError(f"extras fault={fault!r} is not one of {list(FAULTS)} or 'ignore_option:<keyword>'")
    if fault == "perturb_grad_rank1" or fault in CHECKPOINT_FAULTS:
        return  # applied inside the engine's training loop, or when it loads its checkpoint
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


@dataclass
class RankResult:
    """What one rank sends back from ``run_case_on_rank``: plain, picklable data, one fact per field."""

    #: ``unsupported``: the engine cannot run the case here (``reason`` says why); ``ok``: it ran.
    status: Literal["ok", "unsupported"]
    reason: str = ""
    #: every compared quantity, worst over the steps, as this rank saw it.
    findings: list[Finding] = field(default_factory=list)
    knobs: list[KnobCheck] = field(default_factory=list)
    #: None when not checked.
    deterministic: bool | None = None
    #: the first difference between the two runs (empty when deterministic or not checked).
    nondeterminism: str = ""
    engine_s: float = 0.0
    reference_s: float = 0.0
    peak_mem_bytes: int = 0
    bytes_all_gathered: int = 0
    bytes_reduce_scattered: int = 0
    #: collectives of the training phases, per kind.
    collectives: dict[str, int] = field(default_factory=dict)
    #: which run's distance widened the tolerances (``harness.compare.tolerance.budget_source``).
    budget_source: BudgetSource = "none"
    #: mixed precision: per reference (``fp64``, ``no_param`` ...), the quantities an engine computing it fails.
    resolvable: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: stress mode: how often each delay point fired (``harness.compare.stress``).
    stress_points: dict[str, int] = field(default_factory=dict)
    #: per quantity (``loss``, ``grad_norm``) and side (``engine``, ``reference``): this rank's value per step.
    curves: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    #: seconds per phase of this rank's job (``harness.compare.phases``).
    phases_s: dict[str, float] = field(default_factory=dict)


def _unsupported(reason: str, phases_s: dict[str, float] | None = None) -> RankResult:
    return RankResult("unsupported", reason, phases_s=phases_s or {})


def _local_observation(case: CaseConfig, spec: PrecisionSpec, ctx: RankContext, order: RankOrder = "ranks") -> Observation:
    return Observation.from_reference(
        LocalReference.for_case(case, spec, ctx.device, ctx.world_size, ctx.local_world_size, order).run(ctx.rank))


def _budgets(
    case: CaseConfig, spec: PrecisionSpec, ctx: RankContext, source: BudgetSource, reference: Observation, notes: list[str]
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """The case's budgets (``harness.compare.tolerance``), worst over the ranks; under mixed precision also which
    quantities each cast-dropping run resolves. Collective: every rank calls it alike."""
    if source == "none":
        return {}, {}
    truth = _local_observation(case, TRUTH_SPEC, ctx)
    if source in ("reference", "emulation"):
        # ``reference`` is the emulation in rank order (measured already); an engine's backend may sum in any other.
        others = [o for o in emulation_orders(ctx.world_size) if o != "ranks"] if source == "emulation" else []
        measured = [reference, *(_local_observation(case, spec, ctx, order) for order in others)]
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, derive_budgets_over(measured, truth))
        return worst_budgets(everyone), {}
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size)
    others = {"fp64": truth}
    for name, ablated in cast_ablations(spec, has_float_buffers(model)).items():
        try:
            others[name] = _local_observation(case, ablated, ctx)
        except RuntimeError as exc:
            # e.g. float32 activations into float16 BatchNorm buffers: an engine dropping this cast
            # raises at the same place, it cannot pass on values.
            notes.append(f"{name}: the model cannot run with that cast dropped ({exc}); an engine dropping it raises")
    drifts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(drifts, measure_drift(reference, others))
    drift = merge_drifts(drifts)
    derived = mixed_precision_budgets(drift.distances, drift.scales, spec.full)
    resolvable = {name: sorted(q for q, b in derived.items() if name in b.resolvable) for name in others}
    return {q: b.budget for q, b in derived.items()}, resolvable


def _resume_unsupported(adapter: EngineAdapter, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
    """Why the engine that resumes the checkpoint cannot (cross-engine resume), or None."""
    if case.checkpoint == "none":
        return None
    if case.checkpoint == "dcp-reshard":
        return unsupported_checkpoint(adapter, adapter, "sharded", case.use_orig_params) or (
            "a resharded run changes the world size half-way, and rank-local modules belong to one rank of "
            "one world size" if model.rank_local_modules() else None)
    loader = resolve(case.resume_engine) if case.resume_engine else adapter
    if loader is not adapter:
        reason = loader.unsupported_reason(case.replace(engine=loader.name, resume_engine=None), model, ctx)
        if reason:
            return f"resuming with {reason}"
    return unsupported_checkpoint(adapter, loader, case.checkpoint, case.use_orig_params)


def _null_gradient_policy(policy: TolerancePolicy, case: CaseConfig, model: ZooModel, reference: Observation,
                          ctx: RankContext, sums_in_own_order: bool = False) -> TolerancePolicy:
    """``policy`` holding the model's null-gradient elements to Adam's drift bound on CUDA ranks, and on any
    rank for an engine that sums gradients in its own order (``EngineAdapter.sums_in_own_order``)
    (``harness.compare.tolerance``: where rounding differs between the sides, Adam steps them on noise)."""
    lr = adam_lr(case)
    ranges = model.null_gradient_ranges()
    if lr is None or (ctx.device_type != "cuda" and not sums_in_own_order) or not ranges:
        return policy
    values = {piece.name: piece.value.reshape(-1) for piece in reference.params}
    magnitude = max((float(values[n][a:b].abs().max()) for n, (a, b) in ranges.items() if n in values and b > a), default=0.0)
    return policy.with_null_gradients(ranges, adam_drift_bound(lr, case.steps, ADAMW_BETAS, ADAMW_WEIGHT_DECAY, magnitude))


#: this rank process's references (``harness.compare.reference_cache``).
REFERENCES: ReferenceCache[CachedReference] = ReferenceCache()


def _reference_with_budgets(case: CaseConfig, spec: PrecisionSpec, source: BudgetSource, ctx: RankContext) -> CachedReference:
    """The case's reference and budgets: from this rank's cache when every rank has them, else computed
    (and kept). Collective: every rank calls it alike."""
    key = reference_key(case, spec, source, ctx.device, ctx.local_world_size) if cacheable(case) else None
    kept = REFERENCES.get(key) if key is not None else None
    if key is not None and consensus(kept is not None, ctx.device):
        REFERENCES.hits += 1
        return kept
    notes: list[str] = []
    reference = _run_reference(case, spec, ctx)
    # Past 2 ranks the budget is the emulation's drift from float64, whichever reference is compared.
    measured = reference if source != "emulation" or case.reference == "local" else _run_reference(case.replace(reference="local"), spec, ctx)
    budgets, resolvable = _budgets(case, spec, ctx, source, measured, notes)
    known = CachedReference(reference, budgets, resolvable, tuple(notes))
    if key is not None:
        REFERENCES.put(key, known)
    return known


def _budget_source(adapter: EngineAdapter, case: CaseConfig, model: ZooModel, world_size: int) -> tuple[PrecisionSpec, BudgetSource]:
    spec = adapter.effective_precision(case, model)
    reorders = case.compile != "none" or case.grad_accum != "none" or adapter.sums_in_own_order
    return spec, budget_source(spec, world_size, reorders=reorders)


def unsupported_here(adapter: EngineAdapter, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
    """Why this case cannot be run and judged on ranks like ``ctx`` (one line), or None: the stress mode's
    device, the engine's own reasons, a resumed run's, and whether the case's reference can judge it.
    What the ranks decide, and what the smoke selection asks before it picks a case (``smoke_refusal``)."""
    reason = (stress_unsupported_reason(case.stress, ctx.device_type) or adapter.unsupported_reason(case, model, ctx)
              or _resume_unsupported(adapter, case, model, ctx))
    if reason:
        return reason
    if _budget_source(adapter, case, model, ctx.world_size)[1] == "ablation" and case.reference != "local":
        # DDP computes in full precision: only the emulation says what the casts should give. Compared
        # with it under this case's id, the grid and the certificate would say DDP and show each failure
        # twice (once here, once as the local case).
        return (f"mixed precision ({case.precision}) against {case.reference}: {case.reference} computes in "
                "full precision, so only the local reference (which emulates the casts) can judge it: "
                "see this case against local")
    return None


def smoke_refusal(device_type: str) -> Callable[[CaseConfig], str | None]:
    """``unsupported_here`` asked in the parent, for ranks on ``device_type``: the smoke generator picks
    cases its engine can run and its reference can judge there (``harness.selection.matrix.generate``'s ``refuse``).
    An engine whose reason needs live ranks to say (it raises here) is left to its ranks."""

    def refuse(case: CaseConfig) -> str | None:
        ctx = RankContext(0, case.world_size, 0, case.world_size, "gloo", torch.device(device_type))
        try:
            model = build_model(case.model, seed=case.seed, rank=0, world_size=case.world_size)
            return unsupported_here(resolve(case.engine), case, model, ctx)
        except Exception:  # noqa: BLE001 - the ranks will say
            return None

    return refuse


def run_case_on_rank(ctx: RankContext, case: CaseConfig) -> RankResult:
    """The pool's job: the whole case as this rank sees it (see ``record_from_outcome``)."""
    if case.world_size != ctx.world_size:
        return _unsupported(f"case world_size={case.world_size} but the ranks are {ctx.world_size}")
    clock = PhaseClock()
    adapter = resolve(case.engine)  # the spec travels in the case; each rank resolves it once
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size)
    reason = unsupported_here(adapter, case, model, ctx)
    if reason:
        clock.lap("setup")
        return _unsupported(reason, clock.seconds)
    _inject_fault(case, ctx)
    spec, source = _budget_source(adapter, case, model, ctx.world_size)
    clock.lap("setup")
    known = _reference_with_budgets(case, spec, source, ctx)
    reference, budgets, resolvable, notes = known.reference, known.budgets, known.resolvable, list(known.notes)
    if ctx.device_type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    clock.lap("reference")
    engine = _run_engine(adapter, case, ctx, case.steps, clock)
    keep_own_run(case, ctx, engine.events)
    clock.lap("steps")
    clock.move(engine.observe_s, "steps", "observe")
    peak = int(torch.cuda.max_memory_allocated(ctx.device)) if ctx.device_type == "cuda" else 0

    policy = _null_gradient_policy(TolerancePolicy.for_precision(spec, budgets, source), case, model, reference, ctx,
                                   adapter.sums_in_own_order)
    findings = compare_observations(engine, reference, policy)
    clock.lap("compare")
    checks = [] if knob_checks_off(case) else knob_checks(adapter, case, ctx, spec, engine, model)
    clock.lap("knobs")

    deterministic: bool | None = None
    nondeterminism = ""
    if case.check_determinism:
        nondeterminism = first_difference(engine, _run_engine(adapter, case, ctx, case.steps))
        deterministic = not nondeterminism
        clock.lap("determinism")

    training = [e for e in engine.events if e.phase in ("forward", "backward", "step")]
    return RankResult(
        "ok",
        findings=findings,
        knobs=checks,
        deterministic=deterministic,
        nondeterminism=nondeterminism,
        engine_s=clock.seconds["build"] + clock.seconds["steps"] + clock.seconds["observe"],
        reference_s=clock.seconds["reference"],
        peak_mem_bytes=peak,
        bytes_all_gathered=total_bytes(training, "all_gather"),
        bytes_reduce_scattered=total_bytes(training, "reduce_scatter"),
        collectives={kind: len(ops(training, op=kind)) for kind in ("all_gather", "reduce_scatter", "all_reduce")},
        budget_source=source,
        resolvable=resolvable,
        notes=notes + engine.notes,
        stress_points=engine.stress_points,
        curves={
            "loss": {"engine": engine.losses, "reference": reference.losses},
            "grad_norm": {"engine": engine.grad_norms, "reference": reference.grad_norms},
        },
        phases_s=clock.seconds,
    )


def knob_checks_off(case: CaseConfig) -> bool:
    """``extras=(("knob_checks", "off"),)``: decide on values alone (how the planted cast-dropping engines
    show that the tolerance catches them without the collective-dtype check)."""
    value = case.extra.get("knob_checks", "on")
    if value not in ("on", "off"):
        raise ValueError(f"extras knob_checks={value!r} must be 'on' or 'off'")
    return value == "off"


# ---------------------------------------------------------------------------------------------------
# The verdict (parent side, pure)


def _failure_line(error: QuantityError, where: dict[str, Any]) -> str:
    at = []
    if where.get("step") is not None:
        at.append(f"step {where['step']}")
    at.append(f"rank {where.get('rank', '?')}")
    if math.isinf(error.max_abs) and math.isinf(error.ratio):
        return f"{error_text(error)} ({', '.join(at)})"
    return f"{error_text(error)} at {' on '.join(at)}"


def non_finite_line(values: list[RankResult]) -> str:
    """``the engine produced NaN at step 3 (loss on rank 1)``: the first step where the engine's loss or
    gradient norm was not finite on some rank, or empty. Every quantity compared after it fails, and
    the engine's result reads as missing there, so this is the reason, not the worst quantity."""
    found = sorted(
        (step, rank, quantity, value)
        for rank, v in enumerate(values)
        for quantity in ("loss", "grad_norm")
        for step, value in enumerate(v.curves.get(quantity, {}).get("engine", []))
        if not math.isfinite(value)
    )
    if not found:
        return ""
    step, rank, quantity, value = found[0]
    return f"the engine produced {'NaN' if math.isnan(value) else 'inf'} at step {step} ({quantity} on rank {rank})"


def record_from_outcome(case: CaseConfig, outcome: PoolOutcome) -> CaseRecord:
    """One all-rank ``CaseRecord`` from what the pool got back for ``run_case_on_rank``."""
    base: dict[str, Any] = {"case": case.to_dict(), "case_id": case.case_id, "wall_s": outcome.wall_s}
    waited = {key: getattr(outcome, key) for key in BEFORE_JOB if getattr(outcome, key)}  # PoolOutcome's own names
    if outcome.status != "ok":
        detail: dict[str, Any] = dict(waited)
        if outcome.errors:
            detail["tracebacks"] = {str(r): portable_paths(e.traceback) for r, e in outcome.errors.items()}
        if outcome.stacks:
            detail["stacks"] = {str(r): portable_paths(s) for r, s in outcome.stacks.items()}
        if outcome.exit_codes:
            detail["exit_codes"] = {str(r): c for r, c in outcome.exit_codes.items()}
        if outcome.stderr_tails:
            detail["stderr_tails"] = {str(r): portable_paths(t) for r, t in outcome.stderr_tails.items()}
        return CaseRecord(verdict=outcome.status, reason=outcome.reason, detail=detail, **base)

    values: list[RankResult] = list(outcome.values)
    phases = [v.phases_s for v in values]
    timing = {"phases_s": busiest(phases), "handoff_s": handoff_s(outcome.wall_s, phases), **waited}
    unsupported = [v for v in values if v.status == "unsupported"]
    if unsupported:
        return CaseRecord(verdict="unsupported", reason=unsupported[0].reason, detail=timing, **base)

    errors, where = merge_quantities([v.findings for v in values])
    rank_order = {"ignored": 2, "ok": 1, "n/a": 0}
    knobs: dict[str, KnobCheck] = {}
    for v in values:
        for check in v.knobs:
            current = knobs.get(check.knob)
            if current is None or rank_order[check.status] > rank_order[current.status]:
                knobs[check.knob] = check
    determinism = [v.deterministic for v in values]
    deterministic = None if any(d is None for d in determinism) else all(determinism)

    reasons: list[str] = []
    failing = sorted((e for e in errors if not e.passed), key=lambda e: -e.ratio)
    non_finite = non_finite_line(values) if failing else ""
    if non_finite:
        reasons.append(f"{non_finite}: {len(failing)} quantities fail from there")
    elif failing:
        reasons.append(_failure_line(failing[0], where[failing[0].name]))
        if len(failing) > 1:
            reasons[-1] += f" (+{len(failing) - 1} more)"
    for check in knobs.values():
        if check.status == "ignored":
            reasons.append(f"knob {check.knob} ignored: {check.reason}")
    if deterministic is False:
        nondet = next(v.nondeterminism for v in values if v.nondeterminism)
        reasons.append(f"not deterministic: {nondet}")
    if not errors:
        reasons.append("nothing was compared")
    if reasons:
        # What the engine says about itself (``harness.engines.owned_step.FINDING``: a default that does not train
        # like DDP) explains a failure better than its worst quantity: it leads the reason.
        reasons[:0] = findings(sorted({n for v in values for n in v.notes}))
    curves = None
    if all(v.curves for v in values):
        curves = {q: {side: [list(v.curves[q][side]) for v in values] for side in ("engine", "reference")}
                  for q in ("loss", "grad_norm")}

    return CaseRecord(
        verdict="fail" if reasons else "pass",
        reason="; ".join(reasons),
        errors=errors,
        deterministic=deterministic,
        peak_mem_bytes=max(v.peak_mem_bytes for v in values),
        bytes_all_gathered=max(v.bytes_all_gathered for v in values),
        bytes_reduce_scattered=max(v.bytes_reduce_scattered for v in values),
        detail={
            "knobs": [asdict(c) for c in knobs.values()],
            "worst_at": {name: where[name] for name in (e.name for e in failing[:10])},
            "engine_s": [v.engine_s for v in values],
            "reference_s": [v.reference_s for v in values],
            **timing,
            "collectives": values[0].collectives,
            "budget_source": values[0].budget_source,
            "resolvable": values[0].resolvable,
            "notes": sorted({n for v in values for n in v.notes}),
            **({"stress_points": values[0].stress_points} if values[0].stress_points else {}),
        },
        curves=curves,
        **base,
    )
