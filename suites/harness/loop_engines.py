"""Planted training-loop bugs: our engine with one slip each, proving each training-loop axis can fail.

- ``clip-local``: ``clip_grad_norm_`` clips every rank's gradient by the norm of its own shard (no
  reduction across ranks): the classic sharded-clipping bug. Fails ``clip_grad='norm'`` cases on values.
- ``sync-always``: ``no_sync()`` does nothing, so every micro-batch reduces its gradient. The numbers are
  those of accumulation with synchronization; only the ``grad_accum`` knob check (reductions counted in
  the micro-batches that should skip them) catches it.
- ``dynamo-traced``: the forward hooks are not kept out of Dynamo (``engine.dynamo.outside_dynamo``
  undone), so a compiled model traces the engine's all-gathers. Fails ``compile='compiled'`` cases.
- ``decay-dropped``: before each optimizer step the engine keeps one weight decay per flat parameter (as
  an engine stepping whole flat shards must) and takes it from the last parameter group holding one of
  the unit's original parameters. A unit that holds weights and biases side by side then gives the
  decay group the no-decay group's zero. One-group optimizers are untouched: fails
  ``optimizer='adamw_groups'`` cases on values.

Importing this module registers the four engines (``harness.engines.registry.register``) and ``decay-dropped``'s
optimizer step pre-hook (process-wide; it touches only optimizers over that engine's parameters) in the
importing process; a pool's ranks import it through ``run_case_with_loop_engines``, the job to send them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import engine
from engine.state import ModuleState
from harness.compare.parity import RankResult, run_case_on_rank
from harness.engines.adapters import FSDP1Adapter, FSDP1Namespace
from harness.engines.registry import register
from harness.ranks.rank import RankContext

__all__ = ["CLIP_LOCAL", "DECAY_DROPPED", "DYNAMO_TRACED", "SYNC_ALWAYS", "run_case_with_loop_engines"]

CLIP_LOCAL = "clip-local"
SYNC_ALWAYS = "sync-always"
DYNAMO_TRACED = "dynamo-traced"
DECAY_DROPPED = "decay-dropped"


class ClipLocalFSDP(engine.FullyShardedDataParallel):
    """Clips by this rank's own shard norm."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) if grads else torch.zeros(())
        coef = max_norm / (float(local) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)
        return local


class SyncAlwaysFSDP(engine.FullyShardedDataParallel):
    """``no_sync()`` that synchronizes anyway."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


class _TracedState(ModuleState):
    """The module state with its forward hooks visible to Dynamo again."""

    lazy_init = ModuleState.lazy_init.__wrapped__  # type: ignore[attr-defined]
    root_pre_forward = ModuleState.root_pre_forward.__wrapped__  # type: ignore[attr-defined]
    pre_forward = ModuleState.pre_forward.__wrapped__  # type: ignore[attr-defined]
    post_forward = ModuleState.post_forward.__wrapped__  # type: ignore[attr-defined]


class DynamoTracedFSDP(engine.FullyShardedDataParallel):
    """Forward hooks Dynamo traces."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fsdp_state.__class__ = _TracedState


class DecayDroppedFSDP(engine.FullyShardedDataParallel):
    """One weight decay per flat parameter, the last group's (``_decay_per_flat_parameter``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _DECAY_DROPPED_UNITS.add(self)


#: the live units of ``DecayDroppedFSDP``: the step hook touches only optimizers over their parameters.
_DECAY_DROPPED_UNITS: "weakref.WeakSet[DecayDroppedFSDP]" = weakref.WeakSet()


def _decay_per_flat_parameter(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The slip: a flat parameter's weight decay is that of the last group holding one of its originals,
    written back onto every group whose first parameter it holds."""
    flat_of = {
        id(p): id(unit._handle.flat_param)
        for unit in list(_DECAY_DROPPED_UNITS) if unit._handle is not None
        for p in unit._handle._orig_params
    }
    decay: dict[int, float] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in flat_of and "weight_decay" in group:
                decay[flat_of[id(p)]] = group["weight_decay"]
    for group in optimizer.param_groups:
        flats = [flat_of[id(p)] for p in group["params"] if id(p) in flat_of]
        if flats and "weight_decay" in group:
            group["weight_decay"] = decay[flats[0]]


# Process-wide, as an engine that steps flat shards registers it; inert for optimizers over other engines.
register_optimizer_step_pre_hook(_decay_per_flat_parameter)


class _PlantedAdapter(FSDP1Adapter):
    """The built-in engine's adapter with another ``FullyShardedDataParallel`` class."""

    def __init__(self, name: str, fsdp: type) -> None:
        super().__init__(name, "engine")
        self._planted = fsdp

    @property
    def ns(self) -> FSDP1Namespace:
        return dataclasses.replace(FSDP1Namespace.load("engine"), FullyShardedDataParallel=self._planted)


def run_case_with_loop_engines(ctx: RankContext, case: Any) -> RankResult:
    """``harness.compare.parity.run_case_on_rank`` on a rank that has imported (and so registered) the doubles."""
    return run_case_on_rank(ctx, case)


for _name, _fsdp in ((CLIP_LOCAL, ClipLocalFSDP), (SYNC_ALWAYS, SyncAlwaysFSDP), (DYNAMO_TRACED, DynamoTracedFSDP),
                     (DECAY_DROPPED, DecayDroppedFSDP)):
    register(_name, lambda name, fsdp=_fsdp: _PlantedAdapter(name, fsdp))
