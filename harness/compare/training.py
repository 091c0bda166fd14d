"""The training loop every engine, DDP and the resumed runs share, on one rank.

``train`` builds the case's optimizer (``harness.engines.optim``) and runs ``train_steps``, which trains given
global step numbers (each rank its own batch per ``(seed, step, rank)``) and appends what it saw to an
``Observation``: the rank's loss, the norm of the gradient its optimizer applies (gathered over the
context's ranks: shared pieces once, rank-local ones this rank's own), and the gradient pieces the engine
holds. A resumed run (``harness.compare.resume``) calls ``train_steps`` twice, around its checkpoint.

A step of a case with ``grad_accum`` runs ``ACCUM_MICRO_BATCHES`` micro-batches
(``CaseConfig.micro_batches``), each loss divided by their count; with ``no_sync`` all but the last skip
gradient synchronization (``EngineTrainee.skip_sync``) and run in the trace phases ``accumulate_forward``
and ``accumulate_backward``, so a knob check can see an engine that reduces them anyway. With
``clip_grad`` the side clips its gradients (``EngineTrainee.clip_grad_norm``, phase ``clip``) before they
are read and stepped, and the total norm it returns is observed every step. An engine that owns its training step
(``EngineTrainee.owned``, ``harness.engines.owned_step``) runs its own backward and step in the same loop.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.cases.case import CLIP_MAX_NORM, CaseConfig
from harness.cases.dtypes import dtype_of
from harness.cases.models import ZooModel, build_model, gpu_sleep, to_device
from harness.compare.compare import Observation
from harness.compare.stress import Stress
from harness.compare.trace import CommTrace
from harness.engines.adapters import EngineTrainee, ParamSlice, rank_local_param_names
from harness.engines.optim import build_optimizers, freeze, zero_grads
from harness.ranks.rank import RankContext

#: the trace phases of a micro-batch that skips synchronization start with this.
ACCUMULATE = "accumulate_"

__all__ = ["ACCUMULATE", "ParamInfo", "fresh_model", "mark_phase", "observing", "paused", "train", "train_steps"]


@dataclass(frozen=True)
class ParamInfo:
    """An original parameter as the unwrapped model has it (wrappers rename and flatten)."""

    numel: int
    trainable: bool
    #: belongs to a rank-local module: this rank's own, never reduced.
    rank_local: bool
    #: dimensions (wrappers may show a flattened shard instead: parameter groups decide by this).
    dim: int = 1


def _param_table(model: ZooModel) -> dict[str, ParamInfo]:
    local = rank_local_param_names(model)
    return {name: ParamInfo(p.numel(), p.requires_grad, name in local, p.dim()) for name, p in model.named_parameters()}


@dataclass(frozen=True)
class _StepPieces:
    """One step's gradient pieces as the norm needs them: ``(name, start, numel, squared sum)`` of the shared
    pieces (gathered over the ranks) and of this rank's rank-local ones."""

    shared: list[tuple[str, int, int, float]]
    local: list[tuple[str, int, int, float]]


def _step_pieces(slices: Sequence[ParamSlice], local_names: set[str]) -> _StepPieces:
    pieces = [(s.name, s.start, s.numel, float(s.value.double().pow(2).sum())) for s in slices]
    return _StepPieces([p for p in pieces if p[0] not in local_names], [p for p in pieces if p[0] in local_names])


def _gather_grad_norms(steps: Sequence[_StepPieces], table: dict[str, ParamInfo],
                       ctx: RankContext) -> list[tuple[float, dict[str, int]]]:
    """Per step, this rank's gradient norm from every rank's pieces, and the elements no piece covered.

    Shared pieces are counted once however many ranks hold them (replicas, NO_SHARD); rank-local
    ones are this rank's own. One gather for all the steps of a run: nothing reads a norm before the run
    ends, and each gather is a collective (two over NCCL, with host copies) every rank waits on.
    """
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, [step.shared for step in steps], group=ctx.world_group())
    return [_norm_and_gaps([part[i] for part in everyone], step.local, table) for i, step in enumerate(steps)]


def _norm_and_gaps(shared: Sequence[Sequence[tuple[str, int, int, float]]], local: Sequence[tuple[str, int, int, float]],
                   table: dict[str, ParamInfo]) -> tuple[float, dict[str, int]]:
    """One step's norm and coverage gaps from every rank's shared pieces (rank order) and this rank's local ones."""
    unique: dict[tuple[str, int, int], float] = {}
    for part in shared:
        for name, start, numel, sq in part:
            unique.setdefault((name, start, numel), sq)
    total = sum(unique.values())
    total += sum(sq for _, _, _, sq in local)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, start, numel in unique:
        ranges.setdefault(name, []).append((start, start + numel))
    for name, start, numel, _ in local:
        ranges.setdefault(name, []).append((start, start + numel))
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


@contextlib.contextmanager
def observing(obs: Observation, trace: CommTrace | None) -> Iterator[None]:
    """The body reads what the side holds for the comparison: outside the trace, its host time added to
    ``obs.observe_s`` (a case's ``observe`` phase). No synchronization is added to time it: one before the
    gradients are read would finish an engine's pending copies (an offloaded gradient's) before its optimizer
    step and hide the race the stress cases exist to show; so on CUDA a read's wait for kernels the step
    queued counts here."""
    start = time.perf_counter()
    with paused(trace):
        yield
    obs.observe_s += time.perf_counter() - start


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
    # An engine that owns its step wraps its own optimizer (``harness.engines.owned_step``): the harness builds none.
    optimizers = [] if trainee.owned is not None else build_optimizers(
        case, trainee.named_trainable_parameters(), {n: info.dim for n, info in table.items()})
    if stress is not None:
        for optimizer in optimizers:
            stress.watch_optimizer(optimizer)
    obs = Observation()
    train_steps(trainee, optimizers, case, ctx, range(steps), table, obs, trace=trace, perturb=perturb)
    with observing(obs, trace), (stress.around("around_summon") if stress is not None else contextlib.nullcontext()):
        obs.params = trainee.final_params()
    obs.notes.extend(trainee.notes)
    return obs


def train_steps(
    trainee: EngineTrainee,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
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
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    zoo = trainee.zoo
    full = dtype_of(case.precision_spec.full)
    pieces: list[_StepPieces] = []
    local_names = {name for name, info in table.items() if info.rank_local}
    for step in steps:
        batches = case.micro_batches(step)
        loss_seen = 0.0
        for i, batch_step in enumerate(batches):
            last = i == len(batches) - 1
            skip = case.grad_accum == "no_sync" and not last
            inputs = to_device(zoo.get_input(seed=case.seed, step=batch_step, rank=ctx.rank), ctx.device, full)
            with trainee.skip_sync() if skip else contextlib.nullcontext():
                mark_phase(trace, f"{ACCUMULATE}forward" if skip else "forward", step)
                output = trainee.module(*inputs)
                loss = zoo.get_loss(inputs, output)
                mark_phase(trace, f"{ACCUMULATE}backward" if skip else "backward", step)
                # One batch keeps its loss as it is (the cases without accumulation stay bitwise as they were).
                scaled = loss / len(batches) if len(batches) > 1 else loss
                if trainee.owned is not None:
                    trainee.owned.backward(scaled)
                else:
                    zoo.run_backward(scaled)
            loss_seen += float(loss.detach().double()) / len(batches)
        if perturb:
            _perturb_gradient(trainee)
        if case.clip_grad == "norm":
            mark_phase(trace, "clip", step)
            obs.clip_norms.append(trainee.clip_grad_norm(CLIP_MAX_NORM))
        with observing(obs, trace):
            slices = trainee.grad_slices()
            pieces.append(_step_pieces(slices, local_names))
        obs.losses.append(loss_seen)
        obs.grads.append(slices)
        mark_phase(trace, "step", step)
        gpu_sleep(zoo.sleeps.before_step_ms, ctx.device)
        if trainee.owned is not None:
            trainee.owned.step()
        for opt in optimizers:
            opt.step()
        zero_grads(case, optimizers)
    if pieces:  # every rank trains the same steps, so every rank gathers or none does
        with observing(obs, trace):
            for norm, gaps in _gather_grad_norms(pieces, table, ctx):
                obs.grad_norms.append(norm)
                for name, missing in gaps.items():
                    obs.coverage_gaps[name] = max(missing, obs.coverage_gaps.get(name, 0))


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
    freeze(case, model, rank_local_param_names(model))
    return model, _param_table(model)
