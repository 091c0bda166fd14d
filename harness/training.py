"""The training loop every engine, DDP and the resumed runs share, on one rank.

``train`` builds the case's optimizer (``harness.optim``) and runs ``train_steps``, which trains given
global step numbers (each rank its own batch per ``(seed, step, rank)``) and appends what it saw to an
``Observation``: the rank's loss, the norm of the gradient its optimizer applies (gathered over the
context's ranks: shared pieces once, rank-local ones this rank's own), and the gradient pieces the engine
holds. A resumed run (``harness.resume``) calls ``train_steps`` twice, around its checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.adapters import EngineTrainee, ParamSlice, rank_local_param_names
from harness.case import CaseConfig
from harness.compare import Observation
from harness.dtypes import dtype_of
from harness.models import ZooModel, build_model, gpu_sleep, to_device
from harness.optim import build_optimizer
from harness.rank import RankContext
from harness.stress import Stress
from harness.trace import CommTrace

__all__ = ["ParamInfo", "fresh_model", "mark_phase", "paused", "train", "train_steps"]


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
    dist.all_gather_object(everyone, mine, group=ctx.world_group())
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


def mark_phase(trace: CommTrace | None, phase: str, step: int) -> None:
    """Tell the trace what the next collectives belong to."""
    if trace is not None:
        trace.phase, trace.step = phase, step


def paused(trace: CommTrace | None) -> contextlib.AbstractContextManager[None]:
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
    stress: Stress | None = None,
) -> Observation:
    """The shared training loop of engines and DDP: ``steps`` steps, reading gradients after each backward.

    ``table`` describes the model's parameters, taken before wrapping; ``stress`` (engines of a
    stressed case) adds its optimizer and final-unshard delays.
    """
    optimizer = build_optimizer(case, trainee.trainable_parameters())
    if stress is not None:
        stress.watch_optimizer(optimizer)
    obs = Observation()
    train_steps(trainee, optimizer, case, ctx, range(steps), table, obs, trace=trace, perturb=perturb)
    with paused(trace), (stress.around("around_summon") if stress is not None else contextlib.nullcontext()):
        obs.params = trainee.final_params()
    obs.notes.extend(trainee.notes)
    return obs


def train_steps(
    trainee: EngineTrainee,
    optimizer: torch.optim.Optimizer,
    case: CaseConfig,
    ctx: RankContext,
    steps: range,
    table: dict[str, ParamInfo],
    obs: Observation,
    *,
    trace: CommTrace | None = None,
    perturb: bool = False,
) -> None:
    """Train ``steps`` (global step numbers: the batches depend on them) and append what was seen to ``obs``."""
    zoo = trainee.zoo
    full = dtype_of(case.precision_spec.full)
    for step in steps:
        inputs = to_device(zoo.get_input(seed=case.seed, step=step, rank=ctx.rank), ctx.device, full)
        mark_phase(trace, "forward", step)
        output = trainee.module(*inputs)
        loss = zoo.get_loss(inputs, output)
        mark_phase(trace, "backward", step)
        zoo.run_backward(loss)
        if perturb:
            _perturb_gradient(trainee)
        with paused(trace):
            slices = trainee.grad_slices()
            norm, gaps = _gather_grad_norm(slices, table, ctx)
        obs.losses.append(float(loss.detach().double()))
        obs.grad_norms.append(norm)
        obs.grads.append(slices)
        for name, missing in gaps.items():
            obs.coverage_gaps[name] = max(missing, obs.coverage_gaps.get(name, 0))
        mark_phase(trace, "step", step)
        gpu_sleep(zoo.sleeps.before_step_ms, ctx.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


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


def fresh_model(case: CaseConfig, ctx: RankContext, seed: int | None = None) -> tuple[ZooModel, dict[str, ParamInfo]]:
    """The case's model on CPU in its full-precision dtype, and its parameter table (before wrapping).

    ``seed`` overrides the case's initialisation seed (a model a checkpoint is loaded into starts
    elsewhere, so that only a correct load puts it back on the trajectory)."""
    model = build_model(case.model, seed=case.seed if seed is None else seed, rank=ctx.rank, world_size=ctx.world_size)
    model.to(dtype_of(case.precision_spec.full))
    return model, _param_table(model)
