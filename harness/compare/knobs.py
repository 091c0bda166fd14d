"""Knob checks: no setting of a case may be silently ignored by the engine under test.

The sharding strategy shows in which all-gathers and reductions the engine's communication trace
holds, the precision in their dtypes, a prefetch setting must reorder the trace against the same case
without it (FSDP2, which cannot turn backward prefetch off, must show an all-gather issued ahead of the
previous unit's reduction), offload must leave the sharded parameters on CPU and no offload on the
device (which is also where ``init_mode="never"`` must have put them: the other init modes are the
harness's own moves), and every parameter and gradient a user can see must be where offload promises
at every point of a step (``offload_placement``, over the record of ``harness.compare.offload_probe``),
``use_orig_params`` decides whether flat parameters are exposed. A check that cannot see anything in a
case (one unit, CPU-only ranks) says ``n/a`` rather than pass. Pure functions over the trace and plain
facts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from harness.cases.case import ZERO_STRATEGIES, PrecisionSpec, is_hybrid
from harness.compare.param_devices import COMPUTE_POINTS, PARAMETER_POINTS, PlacementLog, offload_violations
from harness.compare.trace import CommEvent, movable_gathers, ops, signature

__all__ = [
    "KnobCheck",
    "check_backward_prefetch_structure",
    "check_grad_accum",
    "check_offload",
    "check_offload_placement",
    "check_order_changed",
    "check_precision",
    "check_sharding",
    "check_use_orig_params",
]

KnobStatus = Literal["ok", "ignored", "n/a"]


@dataclass
class KnobCheck:
    """Whether a setting showed its effect: ``ok``, ``ignored`` (fails the case) or ``n/a`` (nothing to see)."""

    knob: str
    status: KnobStatus
    reason: str


_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def _on(event: CommEvent, ranks: Sequence[int]) -> bool:
    """Whether ``event`` ran on the group of exactly ``ranks`` (by size where its ranks were not read)."""
    return event.group_ranks == tuple(ranks) if event.group_ranks else event.group_size == len(ranks)


def check_sharding(
    strategy: str,
    events: Sequence[CommEvent],
    sharded_units: int,
    hybrid_groups: tuple[Sequence[int], Sequence[int]] | None = None,
    world_size: int = 2,
) -> KnobCheck:
    """The strategy in the trace: which phases all-gather, and how gradients are reduced; under hybrid
    sharding (``hybrid_groups``: this rank's shard and replicate group ranks) also on which groups:
    gathers and reduce-scatters within the shard group, the all-reduce across the replicas. On one rank
    there is nothing to gather or reduce (FSDP1 runs every strategy as NO_SHARD there): ``n/a``."""
    if world_size == 1:
        return KnobCheck("sharding_strategy", "n/a", "one rank: no all-gather or gradient reduction to observe")
    fwd_ag = ops(events, op="all_gather", phase="forward")
    bwd_ag = ops(events, op="all_gather", phase="backward")
    rs = ops(events, op="reduce_scatter", phase="backward")
    ar = ops(events, op="all_reduce", phase="backward")
    seen = f"forward all-gathers {len(fwd_ag)}, backward all-gathers {len(bwd_ag)}, reduce-scatters {len(rs)}, all-reduces {len(ar)}"
    knob = "sharding_strategy"
    shard, replicate = hybrid_groups if is_hybrid(strategy) and hybrid_groups is not None else ((), ())
    if len(replicate) == world_size:
        # One rank per shard group (one GPU per node): nothing to gather or scatter within it; all the
        # averaging is the all-reduce across the replicas.
        ok = any(_on(e, replicate) for e in ar)
        expected = f"one-rank shard groups: gradients all-reduced across the replicas {list(replicate)}"
        return KnobCheck(knob, "ok", seen) if ok else KnobCheck(knob, "ignored", f"{strategy}: expected {expected}; saw {seen}")
    if strategy in ZERO_STRATEGIES:
        return _check_zero(strategy, events, seen)
    if strategy == "no_shard":
        ok = not fwd_ag and not bwd_ag and not rs and len(ar) > 0
        expected = "no all-gather or reduce-scatter, gradients all-reduced"
    elif strategy in ("shard_grad_op", "hybrid_shard_zero2"):
        ok = bool(fwd_ag) and not bwd_ag and bool(rs)
        expected = "all-gathers in forward only (parameters kept until backward ends), gradients reduce-scattered"
    else:
        if sharded_units == 0:
            return KnobCheck(knob, "n/a", "no unit besides the root, which is never resharded after forward")
        ok = bool(fwd_ag) and bool(bwd_ag) and bool(rs)
        expected = "parameters re-gathered in backward, gradients reduce-scattered"
    if len(replicate) > 1:
        off_shard = [e for e in fwd_ag + bwd_ag + rs if not _on(e, shard)]
        ok = ok and not off_shard and any(_on(e, replicate) for e in ar)
        expected += f" within the shard group {list(shard)}, and all-reduced across the replicas {list(replicate)}"
        if off_shard:
            seen += f"; {len(off_shard)} on other groups, e.g. {off_shard[0].op} on ranks {list(off_shard[0].group_ranks)}"
    if ok:
        return KnobCheck(knob, "ok", seen)
    return KnobCheck(knob, "ignored", f"{strategy}: expected {expected}; saw {seen}")


def _check_zero(strategy: str, events: Sequence[CommEvent], seen: str) -> KnobCheck:
    """ZeRO-1/2 never shard parameters for compute: nothing is gathered in backward, gradients are reduced
    in backward (all-reduced or reduce-scattered), and each rank's updated partition is all-gathered
    once the optimizer stepped: right after the step (DeepSpeed) or lazily, in the next forward
    (Megatron-FSDP's ``optim``/``optim_grads``, which also fills its compute buffer by an all-gather in
    the first forward: measured on two NCCL GPUs). A lazy sync looks like SHARD_GRAD_OP's forward
    gathers in a trace, and whether gradients stay partitioned (ZeRO-2) shows in memory: the check tells
    these strategies from FULL_SHARD (gathers in backward) and NO_SHARD (nothing gathered)."""
    forward = ops(events, op="all_gather", phase="forward")
    backward = ops(events, op="all_gather", phase="backward")
    reduced = ops(events, op=("all_reduce", "reduce_scatter"), phase="backward")
    after_step = ops(events, op="all_gather", phase="step")
    seen = f"{seen}; all-gathers after the step {len(after_step)}"
    ok = not backward and bool(reduced) and bool(after_step or forward)
    if ok:
        return KnobCheck("sharding_strategy", "ok", seen)
    expected = ("no all-gather in backward (parameters kept whole for compute), gradients reduced in backward, "
                "the updated partitions all-gathered after the step or in the next forward")
    return KnobCheck("sharding_strategy", "ignored", f"{strategy}: expected {expected}; saw {seen}")


def check_precision(spec: PrecisionSpec, events: Sequence[CommEvent]) -> KnobCheck:
    """All-gathers carry the compute dtype and gradient reductions the reduce dtype."""
    param, reduce = spec.compute, spec.reduced
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


#: points each missing utility leaves unrecorded.
_UTILITY_POINTS = {
    "summon": ("in_summon", "after_summon", "in_summon_offload_to_cpu", "after_summon_offload_to_cpu"),
    "summon_offload_to_cpu": ("in_summon_offload_to_cpu", "after_summon_offload_to_cpu"),
    "no_sync": ("in_no_sync", "after_no_sync"),
}
#: violations the reason names before it counts the rest.
_SHOWN = 3


def check_offload_placement(log: PlacementLog, compute_device: str, not_observed: Mapping[str, str] | None = None) -> KnobCheck:
    """Every parameter and gradient of ``log`` (``harness.compare.param_devices``, one probe step under
    ``CPUOffload(offload_params=True)``) where offload promises it; ``compute_device`` is the device type
    the ranks compute on, ``not_observed`` the utilities the engine has not (utility -> why)."""
    knob = "offload_placement"
    not_observed = dict(not_observed or {})
    violations = offload_violations(log, compute_device)
    if violations:
        shown = "; ".join(str(v) for v in violations[:_SHOWN])
        more = f" (+{len(violations) - _SHOWN} more)" if len(violations) > _SHOWN else ""
        return KnobCheck(knob, "ignored", f"cpu_offload=True: {shown}{more}")
    skipped = {p for utility in not_observed for p in _UTILITY_POINTS.get(utility, ())}
    unrecorded = [p for p in (*PARAMETER_POINTS, *COMPUTE_POINTS) if p not in log and p not in skipped]
    placements = sum(len(placement) for placement in log.values())
    seen = f"{placements} placements at {len(log)} points"
    why: dict[str, list[str]] = {}
    for utility, reason in not_observed.items():
        why.setdefault(reason, []).append(utility)
    gaps = [f"{', '.join(utilities)} not observed: {reason}" for reason, utilities in why.items()]
    if unrecorded:
        gaps.append(f"not recorded: {', '.join(unrecorded)}")
    tail = f" ({'; '.join(gaps)})" if gaps else ""
    if not placements:
        return KnobCheck(knob, "n/a", f"no parameter recorded{tail}")
    if compute_device == "cpu":
        return KnobCheck(knob, "n/a", f"the ranks compute on CPU: every device is the CPU; {seen}{tail}")
    return KnobCheck(
        knob, "ok", f"{seen}: on the CPU outside forward and backward, on {compute_device} in them and in summon_full_params{tail}"
    )


def check_use_orig_params(use_orig_params: bool, exposes_flat_params: bool | None) -> KnobCheck:
    if exposes_flat_params is None:
        return KnobCheck("use_orig_params", "n/a", "the engine has no flat parameters")
    if exposes_flat_params != use_orig_params:
        what = "flat parameters" if exposes_flat_params else "original parameters"
        return KnobCheck("use_orig_params", "ok", f"module.parameters() yields {what}")
    what = "flat parameters" if exposes_flat_params else "original parameters"
    return KnobCheck("use_orig_params", "ignored", f"use_orig_params={use_orig_params} but module.parameters() yields {what}")


def check_grad_accum(grad_accum: str, events: Sequence[CommEvent], world_size: int) -> KnobCheck:
    """``no_sync``: the micro-batches that accumulate (trace phases ``accumulate_forward`` and
    ``accumulate_backward``) reduce no gradient; the last one's backward does. Same numbers either way, so
    only the trace can show an engine that synchronizes every micro-batch."""
    knob = "grad_accum"
    if grad_accum != "no_sync":
        return KnobCheck(knob, "n/a", f"grad_accum={grad_accum!r}: every micro-batch synchronizes")
    if world_size == 1:
        return KnobCheck(knob, "n/a", "one rank: no gradient reduction to observe")
    early = [e for e in ops(events, op=("reduce_scatter", "all_reduce")) if e.phase.startswith("accumulate_")]
    last = ops(events, op=("reduce_scatter", "all_reduce"), phase="backward")
    seen = f"{len(early)} reductions in the no_sync micro-batches, {len(last)} in the last micro-batch's backward"
    if early or not last:
        return KnobCheck(knob, "ignored", f"no_sync: expected reductions only after the last micro-batch; saw {seen}")
    return KnobCheck(knob, "ok", seen)
