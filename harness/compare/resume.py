"""A run that is checkpointed and resumed half-way (``CaseConfig.checkpoint``), on one rank.

``run_resumed`` trains ``case.checkpoint_step`` steps, saves model and optimizer with the case's
state-dict type (``harness.engines.checkpoint``), drops the model, wrapper and optimizer, builds fresh ones
(the model initialised from another seed, so that only a correct load brings it back), loads, and
trains the remaining steps, into one ``Observation``: the whole trajectory is compared with the
uninterrupted reference at the case's own tolerance. ``resume_engine`` resumes with another engine.

``dcp-reshard`` saves a sharded checkpoint on ranks ``0..a-1`` and resumes on ranks ``0..b-1``
(``case.reshard == (a, b)``; the larger is the case's world size); ``b == 1`` resumes as the plain,
unwrapped model on rank 0. A rank sees the steps it took part in; the local reference replays the
same change of world size (``harness.engines.references``).

Saving and loading run with the communication trace paused: the knob checks judge training only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.case import CaseConfig
from harness.cases.models import ZooModel
from harness.compare.compare import Observation
from harness.compare.trace import CommTrace
from harness.compare.training import ParamInfo, fresh_model, mark_phase, observing, paused, train_steps
from harness.engines.adapters import EngineAdapter, EngineFacts, EngineTrainee, ParamSlice
from harness.engines.checkpoint import load_checkpoint, load_plain, save_checkpoint, shared_tempdir
from harness.engines.optim import build_optimizer
from harness.engines.registry import resolve
from harness.ranks.rank import RankContext

__all__ = ["RESUME_SEED_OFFSET", "plain_trainee", "run_resumed"]

#: a resumed model is initialised from ``case.seed + RESUME_SEED_OFFSET``: away from the saved state.
RESUME_SEED_OFFSET = 7919


def plain_trainee(model: nn.Module, zoo: nn.Module, device_type: str) -> EngineTrainee:
    """An unwrapped model as a trainee: every gradient and parameter in full, on this rank alone."""

    def grads() -> list[ParamSlice]:
        return [ParamSlice.full(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]

    def params() -> list[ParamSlice]:
        return [ParamSlice.full(n, p) for n, p in model.named_parameters()]

    return EngineTrainee(model, zoo, grads, params, lambda: EngineFacts({device_type}, None))  # type: ignore[arg-type]


def _fault(case: CaseConfig) -> str:
    return str(case.extra.get("fault", ""))


def _optimizers(case: CaseConfig, trainee: EngineTrainee) -> list[torch.optim.Optimizer]:
    """The harness's optimizer of ``trainee``; none for an engine that owns its step (it wraps its own)."""
    return [] if trainee.owned is not None else [build_optimizer(case, trainee.trainable_parameters())]


def _save(adapter: EngineAdapter, trainee: EngineTrainee, optimizers: list[torch.optim.Optimizer], kind: str,
          path: Path, ctx: RankContext) -> None:
    """Save through the engine's own hook where it owns its step, else the harness's FSDP paths."""
    if trainee.owned is None:
        save_checkpoint(adapter, trainee.module, optimizers[0], kind, path, ctx)
    elif trainee.owned.save is None:
        raise NotImplementedError(f"{adapter.name} owns its step and exposes no checkpoint save hook")
    else:
        trainee.owned.save(kind, path, ctx)


def _load(adapter: EngineAdapter, trainee: EngineTrainee, optimizers: list[torch.optim.Optimizer], kind: str,
          path: Path, ctx: RankContext, fault: str) -> None:
    """Load through the engine's own hook where it owns its step, else the harness's FSDP paths."""
    if trainee.owned is None:
        load_checkpoint(adapter, trainee.module, optimizers[0], kind, path, ctx, fault)
    elif trainee.owned.load is None:
        raise NotImplementedError(f"{adapter.name} owns its step and exposes no checkpoint load hook")
    else:
        trainee.owned.load(kind, path, ctx, fault)


@contextlib.contextmanager
def _checkpoint_dir(ctx: RankContext, trace: CommTrace) -> Iterator[Path]:
    """``shared_tempdir`` with its own collectives (name broadcast, final barrier) left out of the trace."""
    stack = contextlib.ExitStack()
    with paused(trace):
        path = stack.enter_context(shared_tempdir(ctx))
    try:
        yield path
    finally:
        with paused(trace):
            stack.close()


def _train_before_checkpoint(
    adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, trace: CommTrace, perturb: bool, obs: Observation
) -> tuple[ZooModel, dict[str, ParamInfo], EngineTrainee, list[torch.optim.Optimizer]]:
    """Build the case's model and engine on ``ctx``'s ranks and train the steps before the checkpoint;
    ``(model, parameter table, trainee, optimizers)`` (no optimizer where the engine owns its step)."""
    model, table = fresh_model(case, ctx)
    trace.watch_modules(model)
    mark_phase(trace, "setup", 0)
    trainee = adapter.build(case, model, ctx)
    optimizers = _optimizers(case, trainee)
    train_steps(trainee, optimizers, case, ctx, range(case.checkpoint_step), table, obs, trace=trace, perturb=perturb)
    return model, table, trainee, optimizers


def run_resumed(
    adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, steps: int, trace: CommTrace, perturb: bool
) -> tuple[Observation, EngineTrainee]:
    """The case trained ``steps`` steps with a checkpoint after ``case.checkpoint_step``; the observation
    and the last engine trainee of this rank (for its facts)."""
    if case.checkpoint == "dcp-reshard":
        return _run_resharded(adapter, case, ctx, steps, trace, perturb)
    k = case.checkpoint_step
    obs = Observation()
    model, table, trainee, optimizers = _train_before_checkpoint(adapter, case, ctx, trace, perturb, obs)
    loader = resolve(case.resume_engine) if case.resume_engine else adapter
    mark_phase(trace, "checkpoint", k)
    with _checkpoint_dir(ctx, trace) as path, paused(trace):
        _save(adapter, trainee, optimizers, case.checkpoint, path, ctx)
        obs.notes.extend(trainee.notes)
        del trainee, optimizers, model
        resumed_case = case.replace(engine=loader.name, resume_engine=None) if case.resume_engine else case
        model, _ = fresh_model(case, ctx, seed=case.seed + RESUME_SEED_OFFSET)
        trainee = loader.build(resumed_case, model, ctx)
        optimizers = _optimizers(case, trainee)
        _load(loader, trainee, optimizers, case.checkpoint, path, ctx, _fault(case))
    train_steps(trainee, optimizers, case, ctx, range(k, steps), table, obs, trace=trace, perturb=perturb)
    with observing(obs, trace):
        obs.params = trainee.final_params()
    obs.notes.extend(trainee.notes)
    return obs, trainee


def _run_resharded(
    adapter: EngineAdapter, case: CaseConfig, ctx: RankContext, steps: int, trace: CommTrace, perturb: bool
) -> tuple[Observation, EngineTrainee]:
    saving, resuming = case.reshard
    k = case.checkpoint_step
    # Both sub-groups are created now, on every rank, before any of them trains.
    save_ctx, resume_ctx = ctx.prefix(saving), ctx.prefix(resuming)
    obs = Observation()
    last: EngineTrainee | None = None
    with _checkpoint_dir(ctx, trace) as path:
        if save_ctx is not None:
            model, table, trainee, optimizers = _train_before_checkpoint(adapter, case, save_ctx, trace, perturb, obs)
            with paused(trace):
                save_checkpoint(adapter, trainee.module, optimizers[0], "sharded", path, save_ctx)
            obs.notes.extend(trainee.notes)
            last = trainee
            del model, trainee, optimizers
        with paused(trace):
            # The resuming ranks read what the saving ranks wrote.
            dist.barrier(group=ctx.world_group())
        if resume_ctx is not None:
            mark_phase(trace, "checkpoint", k)
            with paused(trace):
                model, table = fresh_model(case, resume_ctx, seed=case.seed + RESUME_SEED_OFFSET)
                if resuming == 1:
                    model.to(resume_ctx.device)
                    trainee = plain_trainee(model, model, resume_ctx.device_type)
                    optimizer = build_optimizer(case, trainee.trainable_parameters())
                    load_plain(model, optimizer, path, _fault(case))
                else:
                    trainee = adapter.build(case, model, resume_ctx)
                    optimizer = build_optimizer(case, trainee.trainable_parameters())
                    load_checkpoint(adapter, trainee.module, optimizer, "sharded", path, resume_ctx, _fault(case))
                    last = trainee
            train_steps(trainee, optimizer, case, resume_ctx, range(k, steps), table, obs, trace=trace, perturb=perturb)
            with observing(obs, trace):
                obs.params = trainee.final_params()
            obs.notes.extend(trainee.notes)
    if last is None:  # rank 0 resuming as the plain model, and it saved too: its engine was the saver
        raise AssertionError("every rank saves or resumes with an engine: the larger group is the whole world")
    return obs, last
