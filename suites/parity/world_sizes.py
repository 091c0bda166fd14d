"""Helpers of ``test_world_sizes``: a model with a parameter smaller than the world, the rank jobs
that run cases on it, and what the flat-parameter layout says each rank should hold.

[Note: ranks that hold only padding]
A flat parameter is cut into ``world_size`` equal chunks of ``ceil(total / world_size)`` elements,
right-padded (``engine.layout``); FSDP2 cuts each parameter's dim 0 with ``torch.chunk``. A unit
smaller than the shard group therefore leaves the last ranks with nothing but padding (FSDP1) or an
empty local tensor (FSDP2), and those ranks still take part in every all-gather and reduce-scatter
of the unit. None of the zoo's units is that small at 8 ranks, so ``UnevenModel`` has a 5-element
gain as a unit of its own, registered in the zoo (``harness.cases.models.register_model``) when this
module is imported: in the parent and in every rank that unpickles one of the jobs here.

[Note: planted reduction bugs]
Past two ranks a full-precision case's tolerance is widened by budgets derived from the reference's
distance from float64 (``harness.compare.tolerance.budget_source``). To show that the widened tolerance still
catches real bugs, ``run_planted_case_job`` runs a case on the built-in engine with a bug planted in
its gradient reduction (``engine.collectives.reduce_scatter_grad``, patched in the rank process for
that case only): every reduced shard off by a relative ``rel``. The references never call the
engine's collectives, so only the engine is wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from engine import collectives
from engine.layout import ParamEntry, aligned_numel, build_layout
from harness.cases.case import CaseConfig, is_hybrid
from harness.cases.models import SequentialModel, build_model, register_model
from harness.cases.records import CaseRecord
from harness.compare.parity import RankResult, record_from_outcome, run_case_on_rank
from harness.engines.adapters import FSDP1Adapter
from harness.engines.registry import resolve
from harness.ranks.placement import hybrid_shard_size
from harness.ranks.pool import RankPool
from harness.ranks.rank import RankContext

__all__ = [
    "GAIN_NUMEL",
    "Holding",
    "UNEVEN",
    "UnevenModel",
    "expected_dim0_holdings",
    "expected_flat_holdings",
    "gain_holding_job",
    "planted_in_builtin_reduction",
    "run_case",
    "run_case_job",
    "run_planted_case",
    "run_planted_case_job",
    "shard_group_size",
]

#: the model name ``UnevenModel`` is registered under (in the rank processes).
UNEVEN = "uneven"
#: elements of the gain: fewer than 8 ranks, so at world size 8 some ranks hold only padding.
GAIN_NUMEL = 5


class Gain(nn.Module):
    """An elementwise learnable scale: one 1-D parameter of ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class UnevenModel(SequentialModel):
    """Linear 8->5, a 5-element gain (its own unit), linear 5->16, linear 16->16 (a unit), linear 16->4.

    The root keeps the three other linears (209 elements: uneven at 8 ranks, but every rank holds
    some); the gain unit is smaller than 8 ranks ([Note: ranks that hold only padding]).
    """

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, GAIN_NUMEL), Gain(GAIN_NUMEL), nn.Linear(GAIN_NUMEL, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        )

    @property
    def gain(self) -> Gain:
        return self.module[1]

    def wrap_units(self) -> list[nn.Module]:
        return [self.module[1], self.module[3]]


register_model(UNEVEN, f"a {GAIN_NUMEL}-element gain as its own unit: ranks past it hold only padding", UnevenModel)


# ---------------------------------------------------------------------------------------------------
# Rank jobs (module-level: the pool pickles them by name)


def run_case_job(ctx: RankContext, case: CaseConfig) -> RankResult:
    """``harness.compare.parity.run_case_on_rank`` from this module, so the rank has ``UnevenModel`` registered."""
    return run_case_on_rank(ctx, case)


def run_case(pool: RankPool, case: CaseConfig) -> CaseRecord:
    """One case on the pool, decided as ``harness run`` decides it."""
    return record_from_outcome(case, pool.run(run_case_job, case))


@contextlib.contextmanager
def planted_in_builtin_reduction(rel: float) -> Iterator[None]:
    """Patch ``engine.collectives.reduce_scatter_grad`` to return every reduced shard times
    ``1 + rel`` for the duration (rank processes only; [Note: planted reduction bugs])."""
    if rel == 0.0:
        raise ValueError("planted_in_builtin_reduction: rel must be non-zero (0 plants nothing)")
    original = collectives.reduce_scatter_grad

    def planted(*args: Any, **kwargs: Any) -> collectives.ReduceResult:
        result = original(*args, **kwargs)
        if result.event is not None:
            # The reduction ran on its own stream: finish it, change the shard, and finish that too.
            result.event.synchronize()
            result.grad.mul_(1.0 + rel)
            torch.cuda.current_stream(result.grad.device).synchronize()
        else:
            result.grad.mul_(1.0 + rel)
        return result

    collectives.reduce_scatter_grad = planted
    try:
        yield
    finally:
        collectives.reduce_scatter_grad = original


def run_planted_case_job(ctx: RankContext, arg: tuple[CaseConfig, float]) -> RankResult:
    """``run_case_job`` with the built-in engine's reduced gradients off by a relative ``arg[1]``."""
    case, rel = arg
    if case.engine != "builtin":
        raise ValueError(f"run_planted_case_job: case.engine={case.engine!r} must be 'builtin' (the bug is planted in engine/)")
    with planted_in_builtin_reduction(rel):
        return run_case_job(ctx, case)


def run_planted_case(pool: RankPool, case: CaseConfig, rel: float) -> CaseRecord:
    """One case with the built-in engine's reduced gradients off by a relative ``rel``, decided as
    ``harness run`` decides it."""
    return record_from_outcome(case, pool.run(run_planted_case_job, (case, rel)))


@dataclass(frozen=True)
class Holding:
    """What one rank's shard of the gain unit holds, right after wrapping."""

    #: elements of each gain parameter in this rank's shard, padding excluded, by name within the unit.
    held: dict[str, int]
    #: elements of the unit's flat-parameter shard, padding included; None for FSDP2 (no flat parameter).
    shard_numel: int | None


def gain_holding_job(ctx: RankContext, case: CaseConfig) -> Holding:
    """Wrap ``UnevenModel`` as the case says and report what this rank holds of the gain unit.

    FSDP1-API engines are read through their public API (``fsdp_modules``, each unit's
    ``_flat_param`` and its ``_shard_param_infos``); FSDP2 through each parameter's local DTensor shard.
    """
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size)
    if not isinstance(model, UnevenModel):
        raise ValueError(f"gain_holding_job: case.model={case.model!r} must be {UNEVEN!r}")
    gain = model.gain
    adapter = resolve(case.engine)
    trainee = adapter.build(case, model, ctx)
    if isinstance(adapter, FSDP1Adapter):
        fsdp = adapter.ns.FullyShardedDataParallel
        unit = next(u for u in fsdp.fsdp_modules(trainee.module) if u.module is gain)
        flat = unit._flat_param
        held = {
            fqn: int(info.numel_in_shard or 0) if info.in_shard else 0
            for fqn, info in zip(flat._fqns, flat._shard_param_infos)
        }
        return Holding(held, int(flat.numel()))
    return Holding({name: int(p.to_local().numel()) for name, p in gain.named_parameters()}, None)


# ---------------------------------------------------------------------------------------------------
# What each rank should hold (pure)


def shard_group_size(case: CaseConfig) -> int:
    """Ranks a unit is sharded over: the world, or for the hybrid strategies the shard group
    (``extras["shard_size"]``, else the harness's default on one host)."""
    if is_hybrid(case.sharding_strategy):
        return hybrid_shard_size(case.extra, case.world_size, case.world_size)
    return case.world_size


def expected_flat_holdings(numels: Sequence[int], world_size: int, use_orig_params: bool, itemsize: int = 4) -> list[list[int]]:
    """Per rank of a shard group of ``world_size``: the elements of each parameter its flat shard
    holds, from ``engine.layout`` (aligned when ``use_orig_params``, as torch FSDP1)."""
    entries = [ParamEntry(f"p{i}", (n,), (1,), True, n) for i, n in enumerate(numels)]
    layout = build_layout(entries, world_size, aligned_numel(itemsize) if use_orig_params else 0)
    out = []
    for rank in range(world_size):
        start, end, _ = layout.shard_bounds(rank)
        infos = layout.shard_param_infos(start, end)
        out.append([int(i.numel_in_shard) if i.in_shard else 0 for i in infos])
    return out


def expected_dim0_holdings(shape: Sequence[int], world_size: int) -> list[int]:
    """Per rank: elements of a parameter FSDP2 shards on dim 0 (``torch.chunk``, which may return fewer chunks)."""
    rows = torch.arange(shape[0]).chunk(world_size)
    row_numel = 1
    for d in shape[1:]:
        row_numel *= d
    return [len(rows[r]) * row_numel if r < len(rows) else 0 for r in range(world_size)]
