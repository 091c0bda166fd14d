"""The references an engine is compared against: torch DDP and the unsharded local model.

- ``build_ddp``: torch ``DistributedDataParallel`` over the same zoo model (rank-local parameters
  ignored), trained like every engine.
- ``LocalReference``: one process computing every rank's batch on an unsharded model, with the
  precision casts the engine makes (see [Note: local reference]); with ``TRUTH_SPEC`` the same run in
  float64, the truth tolerance budgets are measured against, and with a ``cast_ablations`` spec what
  an engine that ignores one ``MixedPrecision`` field computes (``harness.compare.tolerance``).

[Note: local reference]
For every rank ``r`` the local reference runs rank ``r``'s batch through a model holding rank
``r``'s view of the parameters (the shared ones are the same tensors for all ranks; rank-local ones
are ``r``'s own) with ``torch.func.functional_call``: parameters cast to the compute dtype, floating
buffers to the buffer dtype and floating inputs to the compute dtype (what FSDP does to the root's
inputs). Each rank's gradient is cast to the reduce dtype, divided by the pre-divide factor, summed
over ranks (in rank order, or the reverse: ``sum_over_ranks``), divided by the post-divide factor
(FSDP1's split of ``1/world_size``) and cast to the full precision of the master weights, which the
case's optimizer (``harness.engines.optim``, the engine's class and hyperparameters) then updates.
Under a hybrid strategy the sum is taken as the engine takes it: within each shard group, rounded to
the reduce dtype, then across the replicas (``reduce_shard_size``). A rank-local parameter's gradient
is its own rank's, unreduced. The result equals DDP's averaged gradient in full precision and
emulates the engine's rounding in mixed precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn as nn

from harness.cases.case import CLIP_MAX_NORM, CaseConfig, PrecisionSpec, is_hybrid
from harness.cases.dtypes import dtype_of
from harness.cases.models import ZooModel, build_model, to_device
from harness.engines.activation_checkpointing import apply_activation_checkpointing, checkpointed_units
from harness.engines.adapters import EngineFacts, EngineTrainee, ParamSlice, canonical_name, rank_local_param_names
from harness.engines.optim import build_optimizers, freeze, sgd
from harness.ranks.placement import hybrid_shard_size
from harness.ranks.rank import RankContext

__all__ = ["LocalReference", "RankOrder", "ReferenceRun", "TrainingLoop", "TRUTH_SPEC", "all_rank_batch", "build_ddp",
           "cast_ablations", "gradient_divide_factors", "reduce_shard_size", "sum_over_ranks"]

#: The order the local reference adds the ranks' gradients in: rank 0 first, or the last rank first.
RankOrder = Literal["ranks", "reversed"]


def build_ddp(case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineTrainee:
    """torch DDP in the case's full precision; rank-local parameters are left out of its all-reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model.to(ctx.device)
    ignored = sorted(rank_local_param_names(model))
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    # Recomputing a forward changes no number, so the reference checkpoints non-reentrantly in either
    # mode: reentrant checkpointing runs the layers' backward in a nested backward, which DDP's reducer
    # follows only with static_graph=True, and that refuses no_sync in the first step (an internal assert).
    mode = "non_reentrant" if case.activation_checkpointing == "reentrant" else case.activation_checkpointing
    apply_activation_checkpointing(model, checkpointed_units(model), mode)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device_type == "cuda" else None)

    def grads() -> list[ParamSlice]:
        return [ParamSlice.full(canonical_name(n), p.grad) for n, p in model.named_parameters() if p.grad is not None]

    def params() -> list[ParamSlice]:
        return [ParamSlice.full(canonical_name(n), p) for n, p in model.named_parameters()]

    return EngineTrainee(ddp, model, grads, params, lambda: EngineFacts({ctx.device_type}, None), accumulate=ddp.no_sync)


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """FSDP1's split of ``1 / world_size`` into a pre-reduction and a post-reduction division."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor), world_size / factor


def reduce_shard_size(case: CaseConfig, world_size: int, local_world_size: int | None = None) -> int | None:
    """The shard-group size a hybrid case's gradients are summed within before the replicas' sum, or None
    (one sum over every rank). The two-level sum rounds to the reduce dtype twice: at 4 bf16 ranks the
    one-level emulation was 1.65 times its budget away from torch FSDP1 and our engine, which agreed bitwise."""
    if not is_hybrid(case.sharding_strategy):
        return None
    size = hybrid_shard_size(case.extra, world_size, local_world_size)
    return size if 1 <= size < world_size and world_size % size == 0 else None


def sum_over_ranks(grads: Sequence[torch.Tensor], reduce: torch.dtype, pre: float,
                   shard_size: int | None = None, order: RankOrder = "ranks") -> torch.Tensor:
    """The ranks' gradients cast to ``reduce``, pre-divided and summed in rank order (``order="reversed"``:
    the last rank first), each addition rounding to ``reduce``: within each group of ``shard_size``
    consecutive ranks first, then across the groups, where ``shard_size`` splits the ranks
    (``reduce_shard_size``). Past two ranks the order changes the rounding, and no order is the engines':
    a backend picks its own (gloo's ring reduce-scatter at 4 ranks adds chunk ``k``'s ranks as
    ``k+2, k+3, k+1, k``), so budgets are measured over both orders (``harness.compare.tolerance``)."""
    if order not in ("ranks", "reversed"):
        raise ValueError(f"sum_over_ranks: order={order!r} must be 'ranks' or 'reversed'")
    parts = [g.to(reduce) / pre for g in (grads if order == "ranks" else list(reversed(grads)))]
    if shard_size is not None and len(parts) % shard_size == 0 and len(parts) > shard_size:
        parts = [sum(parts[first:first + shard_size]) for first in range(0, len(parts), shard_size)]
    return sum(parts)  # type: ignore[return-value]


@dataclass
class ReferenceRun:
    """What the local reference computed, as rank ``rank`` of the engine sees it."""

    losses: list[float]
    grad_norms: list[float]
    #: per step: full gradient of every trainable parameter (rank ``rank``'s view).
    grads: list[dict[str, torch.Tensor]]
    #: full parameters at the end.
    params: dict[str, torch.Tensor]
    #: per step, with clipping: the total norm before clipping.
    clip_norms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TrainingLoop:
    """What the local reference's loop does besides one batch per step: the case's micro-batches, whether
    all but the last skip synchronization, and the clipping max norm (None: no clipping)."""

    micro_batches: Callable[[int], list[int]] = lambda step: [step]
    skip_sync: bool = False
    clip_max_norm: float | None = None

    @classmethod
    def for_case(cls, case: CaseConfig) -> "TrainingLoop":
        return cls(case.micro_batches, case.grad_accum == "no_sync", CLIP_MAX_NORM if case.clip_grad == "norm" else None)


def case_schedule(case: CaseConfig) -> list[int]:
    """Ranks taking part in each step of a case: ``world_size`` throughout, or a resharded checkpoint's
    saving ranks up to the checkpoint and its resuming ranks after it (``CaseConfig.reshard``)."""
    if not case.reshard:
        return [case.world_size] * case.steps
    saving, resuming = case.reshard
    return [saving if step < case.checkpoint_step else resuming for step in range(case.steps)]


#: ``inputs(step, rank)``: rank ``rank``'s batch at ``step`` (on any device, in any dtype).
InputFn = Callable[[int, int], Sequence[torch.Tensor]]
#: ``loss(inputs, output)``: the scalar a rank runs backward from.
LossFn = Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]


def all_rank_batch(inputs: InputFn, step: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every rank's batch at ``step`` concatenated along the batch dimension, on ``device``: what one
    unsharded model sees to stand for ``world_size`` ranks when its loss is a mean over the batch."""
    every = [to_device(tuple(inputs(step, r)), device) for r in range(world_size)]
    return tuple(torch.cat(parts) for parts in zip(*every))


class LocalReference:
    """One process, no collectives: every rank's batch on an unsharded model ([Note: local reference]).

    ``replicas[r]`` is rank ``r``'s model (one object for every rank when nothing is rank-local);
    ``local_names`` the rank-local parameters. ``for_case`` builds one from the zoo.
    """

    def __init__(
        self,
        replicas: Sequence[nn.Module],
        spec: PrecisionSpec,
        device: torch.device,
        *,
        steps: int,
        lr: float,
        momentum: float,
        inputs: InputFn,
        loss: LossFn,
        local_names: frozenset[str] = frozenset(),
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        schedule: Sequence[int] | None = None,
        make_optimizers: Callable[[list[tuple[str, nn.Parameter]]], list[torch.optim.Optimizer]] | None = None,
        loop: TrainingLoop | None = None,
        shard_size: int | None = None,
        order: RankOrder = "ranks",
    ) -> None:
        if not replicas:
            raise ValueError("LocalReference needs one model per rank (replicas is empty)")
        self.spec = spec
        self.device = device
        self.world_size = len(replicas)
        self.steps = steps
        self.inputs = inputs
        self.loss = loss
        self.full = dtype_of(spec.full)
        self.compute = dtype_of(spec.compute)
        self.reduce = dtype_of(spec.reduced)
        self.buffer = dtype_of(spec.buffer)
        self.replicas = list(replicas)
        for m in {id(m): m for m in self.replicas}.values():
            m.to(device=device, dtype=self.full)
        self.local_names = set(local_names)
        # Master weights: the shared ones from replica 0, the rank-local ones per rank.
        self.shared = {n: p for n, p in self.replicas[0].named_parameters() if n not in self.local_names}
        self.local = [
            {n: p for n, p in replica.named_parameters() if n in self.local_names} for replica in self.replicas
        ]
        named = [(n, p) for n, p in self.shared.items() if p.requires_grad]
        for params in self.local:
            named += [(n, p) for n, p in params.items() if p.requires_grad]
        masters = [p for _, p in named]
        if make_optimizers is not None:
            self.optimizers = make_optimizers(named)
        else:
            self.optimizers = [make_optimizer(masters) if make_optimizer else sgd(masters, lr, momentum)]
        self.masters = masters
        self.loop = loop or TrainingLoop()
        #: ``reduce_shard_size``: the groups the gradients are summed within first; None: one sum.
        self.shard_size = shard_size
        #: the order the ranks' gradients are added in (``sum_over_ranks``).
        self.order = order
        if self.loop.clip_max_norm is not None and self.local_names:
            raise ValueError(
                "LocalReference: clipping with rank-local parameters gives every rank its own total norm, so the "
                "shared parameters would differ across ranks; clip a model without rank-local modules"
            )
        #: ranks taking part in each step (a resharded checkpoint changes it half-way).
        self.schedule = list(schedule) if schedule else [self.world_size] * steps
        if max(self.schedule) > self.world_size:
            raise ValueError(f"LocalReference: schedule {self.schedule} needs more ranks than the {self.world_size} replicas")

    @classmethod
    def for_case(cls, case: CaseConfig, spec: PrecisionSpec, device: torch.device, world_size: int,
                 local_world_size: int | None = None, order: RankOrder = "ranks") -> "LocalReference":
        """The case's zoo model, one replica per rank where the model has rank-local modules, trained with
        the case's optimizer (``harness.engines.optim``) over the case's world-size schedule, its gradients
        summed as the case's strategy sums them on ranks of ``local_world_size`` per node, in ``order``."""
        first = build_model(case.model, seed=case.seed, rank=0, world_size=world_size)
        if first.rank_local_modules():
            replicas = [first] + [build_model(case.model, seed=case.seed, rank=r, world_size=world_size) for r in range(1, world_size)]
        else:
            replicas = [first] * world_size
        local_names = frozenset(rank_local_param_names(first))
        for replica in {id(m): m for m in replicas}.values():
            freeze(case, replica, local_names)
        return cls(
            replicas, spec, device, steps=case.steps, lr=case.lr, momentum=case.momentum,
            inputs=lambda step, r: replicas[r].get_input(seed=case.seed, step=step, rank=r),
            loss=first.get_loss, local_names=local_names,
            make_optimizers=lambda named: build_optimizers(case, named), schedule=case_schedule(case),
            loop=TrainingLoop.for_case(case), shard_size=reduce_shard_size(case, world_size, local_world_size),
            order=order,
        )

    def _view(self, r: int) -> dict[str, nn.Parameter]:
        return {**self.shared, **self.local[r]}

    def _rank_step(self, r: int, step: int, scale: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
        """Rank ``r``'s loss at batch ``step`` and the gradients of the loss divided by ``scale`` (the
        micro-batches of one step)."""
        model = self.replicas[r]
        inputs = to_device(self.inputs(step, r), self.device, self.full)
        inputs = tuple(t.to(self.compute) if t.is_floating_point() else t for t in inputs)
        compute = {n: p.detach().to(self.compute).requires_grad_(p.requires_grad) for n, p in self._view(r).items()}
        buffers = {
            n: b.to(self.buffer) if self.buffer is not None and b.is_floating_point() else b
            for n, b in model.named_buffers()
        }
        output = torch.func.functional_call(model, {**compute, **buffers}, inputs)
        loss = self.loss(inputs, output)
        trainable = [n for n, p in compute.items() if p.requires_grad]
        grads = torch.autograd.grad(loss / scale if scale > 1 else loss, [compute[n] for n in trainable], allow_unused=True)
        return float(loss.detach().double()), {
            n: g if g is not None else torch.zeros_like(compute[n]) for n, g in zip(trainable, grads)
        }

    def run(self, rank: int) -> ReferenceRun:
        """The run as rank ``rank`` sees it: the steps it takes part in, and the parameters if it takes
        part in the last one."""
        out = ReferenceRun([], [], [], {})
        schedule = self.schedule
        for step, world_size in enumerate(schedule):
            pre, post = gradient_divide_factors(world_size)
            batches = self.loop.micro_batches(step)
            k = len(batches)
            micro = [[self._rank_step(r, b, k) for r in range(world_size)] for b in batches]
            losses = [sum(m[r][0] / k for m in micro) for r in range(world_size)]
            if self.loop.skip_sync:
                # Unsynchronized micro-batches accumulate each rank's gradient where it is computed (in the
                # compute dtype); the last one's backward reduces the sum.
                micro = [[(0.0, {n: sum(m[r][1][n] for m in micro) for n in micro[0][r][1]}) for r in range(world_size)]]
            for n, p in self.shared.items():
                if p.requires_grad:
                    p.grad = sum((sum_over_ranks([g[n] for _, g in per_rank], self.reduce, pre, self.shard_size, self.order)
                                  / post).to(self.full) for per_rank in micro)
            for r, params in enumerate(self.local[:world_size]):
                for n, p in params.items():
                    if p.requires_grad:
                        p.grad = sum(m[r][1][n].to(self.reduce).to(self.full) for m in micro)
            if self.loop.clip_max_norm is not None:
                total = torch.nn.utils.clip_grad_norm_(self.masters, self.loop.clip_max_norm)
                if rank < world_size:
                    out.clip_norms.append(float(total.double()))
            if rank < world_size:
                view = {n: p.grad.detach().clone() for n, p in self._view(rank).items() if p.grad is not None}
                out.losses.append(losses[rank])
                out.grad_norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in view.values())))
                out.grads.append({n: g.reshape(-1).cpu() for n, g in view.items()})
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if rank < schedule[-1]:
            out.params = {n: p.detach().reshape(-1).cpu().clone() for n, p in self._view(rank).items()}
        return out


#: The same run in float64 throughout: the yardstick mixed-precision budgets are measured with.
TRUTH_SPEC = PrecisionSpec(full="float64", param=None, reduce=None, buffer=None)


def cast_ablations(spec: PrecisionSpec, has_float_buffers: bool) -> dict[str, PrecisionSpec]:
    """``spec`` with one of its casts dropped (``no_param``, ``no_reduce``, ``no_buffer``): what an engine
    that silently ignores exactly that ``MixedPrecision`` field computes. Only the ablations that change
    the numbers: dropping ``reduce`` where it equals ``param`` (FSDP1 reduces in ``param`` then) or a
    buffer cast on a model without floating buffers changes nothing, and costs a run for nothing."""
    out: dict[str, PrecisionSpec] = {}
    for name in ("param", "reduce", "buffer"):
        if getattr(spec, name) is None or (name == "buffer" and not has_float_buffers):
            continue
        ablated = replace(spec, **{name: None})
        if ablated.casts() != spec.casts():
            out[f"no_{name}"] = ablated
    return out
