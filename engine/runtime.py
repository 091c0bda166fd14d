"""The hooks that drive units through forward and backward.

Per iteration, for each unit (``FullyShardedDataParallel`` instance ``state``):

1. root pre-forward (:func:`root_pre_forward`): lazily create the shared context, put back any
   unit still unsharded from a forward that had no backward, adopt user changes to original
   parameters (writeback), move and cast the inputs;
2. pre-forward (:func:`pre_forward`): all-gather into the unsharded leaf, register compute views,
   prefetch the next unit's all-gather (``forward_prefetch``);
3. post-forward (:func:`post_forward`): free the unsharded parameters (FULL_SHARD/HYBRID_SHARD,
   except the root, whose parameters backward needs first), register the pre-backward hook on
   every output tensor that requires grad;
4. pre-backward (:func:`pre_backward_hook`, on the outputs' gradients): the first one of a
   backward queues the final callback; re-gather the unit, prefetch the next (BACKWARD_PRE);
5. post-backward (:func:`post_backward_hook`, after the gradient accumulates into the unsharded
   leaf): free the unsharded parameters, reduce the gradient (unless in ``no_sync()``), prefetch
   the next (BACKWARD_POST);
6. final callback (:func:`final_callback`, once the whole backward is done): wait for every
   reduction, finish offloaded gradients, reshard units whose post-backward never ran, reset.

[Note: ranks that take different paths]
Every all-gather and reduce-scatter is a collective over the unit's process group: if one rank
runs a unit's forward (or backward) and another does not, the first blocks in the collective.
It does not block forever: the collective fails after the process group's timeout
(``init_process_group(timeout=...)``; gloo raises ``RuntimeError``, NCCL aborts the communicator
with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the default). Units must therefore run the same forward
path on every rank, as with torch FSDP1; the execution order recorded at the first iteration
(``RootContext.exec_order``) is what prefetching relies on, and a different order later only
costs prefetch accuracy, never correctness.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves, tree_map_only

from engine.api import BackwardPrefetch, ShardingStrategy
from engine.context import AllGatherLimiter, RootContext, Streams
from engine.precision import BufferPrecision, BufferState, cast_floating_tensors
from engine.unit import FsdpUnit, ShardedState, TrainingState, ViewState

if TYPE_CHECKING:
    from engine.fully_sharded import FullyShardedDataParallel

#: strategies that keep the unsharded parameters from forward to backward.
NO_RESHARD_AFTER_FORWARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)

__all__ = [
    "final_callback",
    "lazy_init",
    "post_backward_hook",
    "post_forward",
    "pre_backward_hook",
    "pre_forward",
    "root_pre_forward",
]


def _fsdp_states(module: torch.nn.Module) -> list["FullyShardedDataParallel"]:
    return [m for m in module.modules() if getattr(type(m), "_is_fsdp_unit", False)]


def lazy_init(root: "FullyShardedDataParallel") -> None:
    """Make ``root`` the root of every unit in its tree and create their shared context."""
    if root._is_root is not None:
        return
    states = _fsdp_states(root)
    for state in states[1:]:
        # A unit whose forward ran alone first made itself a root; it is nested now.
        state._is_root = False
    root._is_root = True
    device = root._compute_device
    ctx = RootContext(
        device=device,
        streams=Streams.for_device(device),
        limiter=AllGatherLimiter(enabled=root._limit_all_gathers and device.type == "cuda"),
        units=[s._unit for s in states if s._unit is not None],
    )
    ctx.root = root  # type: ignore[attr-defined]
    ctx.states = states
    for state in states:
        state._ctx = ctx
        if state._unit is not None:
            state._unit.lazy_init(functools.partial(post_backward_hook, state))
    ctx.buffers = _buffer_precision(states, device)
    ctx.buffers.to_compute()


def _buffer_precision(states: list["FullyShardedDataParallel"], device: torch.device) -> BufferPrecision:
    """Each unit's buffers with its ``buffer_dtype``, innermost unit first (its setting wins)."""
    ignored: set[torch.nn.Module] = set()
    for state in states:
        ignored |= state._ignored_modules
    owned = []
    for state in reversed(states):
        mp = state._mixed_precision
        owned.append((state._own_buffers(ignored), mp.buffer_dtype if mp is not None else None))
    return BufferPrecision(owned, device)


def _move_inputs(args: Any, kwargs: Any, device: torch.device) -> tuple[Any, Any]:
    def move(t: Tensor) -> Tensor:
        return t.to(device) if t.device != device else t

    return tree_map_only(Tensor, move, (args, kwargs))


def _select_precision(ctx: RootContext) -> None:
    """Decide this iteration's precision per unit and put the buffers in the matching dtype.

    See [Note: full precision in eval] in :mod:`engine.precision`.
    """
    for state in ctx.states:
        if state._unit is not None:
            state._unit.set_full_precision(state._use_full_prec_in_eval and not state.module.training)
    buffers = ctx.buffers
    if buffers is None:
        return
    if any(u.full_precision for u in ctx.units):
        if buffers.state != BufferState.ORIGINAL:
            buffers.to_original()
    elif buffers.state != BufferState.COMPUTE:
        buffers.to_compute()


def root_pre_forward(root: "FullyShardedDataParallel", args: Any, kwargs: Any) -> tuple[Any, Any]:
    ctx = root._ctx
    ctx.forward_count += 1
    if ctx.forward_count >= 2:
        ctx.exec_order.frozen = True
    if all(u.training_state == TrainingState.IDLE for u in ctx.units):
        for unit in ctx.units:
            unit.check_offloaded_placement()
        for unit in ctx.units:
            if unit.view_state == ViewState.COMPUTE or (
                unit.sharded_state != ShardedState.SHARDED and not unit.aliased
            ):
                # Unsharded by a forward that had no backward (eval, or SHARD_GRAD_OP): the
                # optimizer or the user may have changed the shard since.
                unit.reshard(ctx)
        for unit in ctx.units:
            unit.writeback()
        _select_precision(ctx)
    args, kwargs = _move_inputs(args, kwargs, ctx.device)
    mp = root._mixed_precision
    # Root inputs follow the root's training flag even when the root has no parameters (FSDP1).
    full_precision = root._use_full_prec_in_eval and not root.training
    if mp is not None and mp.cast_root_forward_inputs and not full_precision:
        args, kwargs = cast_floating_tensors((args, kwargs), mp.param_dtype)
    return args, kwargs


def pre_forward(state: "FullyShardedDataParallel", args: Any, kwargs: Any) -> tuple[Any, Any]:
    mp = state._mixed_precision
    unit = state._unit
    # Only units with parameters cast (FSDP1): a parameterless unit has nothing to match.
    if unit is not None and not unit.full_precision and mp is not None and mp.cast_forward_inputs:
        args, kwargs = cast_floating_tensors((args, kwargs), mp.param_dtype)
    if unit is None:
        return args, kwargs
    ctx = state._ctx
    unit.training_state = TrainingState.FORWARD
    ctx.exec_order.record_pre_forward(unit)
    unit.unshard(ctx)
    unit.wait_unshard()
    unit.use_compute_views()
    if unit.forward_prefetch:
        _prefetch(ctx, ctx.exec_order.next_forward(unit))
    return args, kwargs


def post_forward(state: "FullyShardedDataParallel", output: Any) -> Any:
    unit = state._unit
    grad_enabled = torch.is_grad_enabled()
    if unit is not None:
        ctx = state._ctx
        ctx.exec_order.record_post_forward(unit)
        # Without grad no backward follows: keep nothing unsharded. The root keeps its
        # parameters for backward, which needs them first.
        free = unit.handle.uses_sharded_strategy and (
            not grad_enabled or (unit.reshard_after_forward and not state._is_root)
        )
        if free:
            unit.reshard(ctx)
        elif unit.use_orig_params and not (grad_enabled and unit.strategy in NO_RESHARD_AFTER_FORWARD):
            # Kept unsharded for backward (the root, NO_SHARD): the original parameters still show
            # the shard between forward and backward, as FSDP1's; with CPU offload that is the CPU.
            # SHARD_GRAD_OP keeps the compute views, which backward must find unchanged.
            unit.use_sharded_views()
        unit.training_state = TrainingState.IDLE
    if grad_enabled:
        hook = functools.partial(pre_backward_hook, state)
        for t in tree_leaves(output):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(hook)
    return output


def _prefetch(ctx: RootContext, unit: FsdpUnit | None) -> None:
    if unit is None or unit.sharded_state != ShardedState.SHARDED:
        return
    unit.unshard(ctx)


def _prefetch_backward(ctx: RootContext, unit: FsdpUnit) -> None:
    target = ctx.exec_order.next_backward(unit)
    # Frozen units are prefetched too: their parameters are still needed in backward to carry the
    # gradient to their inputs (LoRA bases). One whose backward never runs is resharded by the
    # final callback.
    if target is None or target.ran_post_backward or target.handle.unsharded_flat_param is None:
        return
    _prefetch(ctx, target)


def pre_backward_hook(state: "FullyShardedDataParallel", grad: Tensor) -> None:
    ctx = state._ctx
    if not ctx.final_callback_queued:
        ctx.final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(final_callback, ctx))
    unit = state._unit
    if unit is None or unit.ran_pre_backward:
        return None
    unit.ran_pre_backward = True
    unit.training_state = TrainingState.PRE_BACKWARD
    unit.check_no_change_since_forward()
    unit.writeback()
    unit.unshard(ctx)
    unit.wait_unshard()
    if unit.use_orig_params:
        # Backward computes with the unsharded parameters: the original parameters show them
        # (on the compute device) until the post-backward reshard, as FSDP1's.
        unit.use_compute_views()
    if unit.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
        _prefetch_backward(ctx, unit)
    return None


@torch.no_grad()
def post_backward_hook(state: "FullyShardedDataParallel", leaf: Tensor) -> None:
    ctx = state._ctx
    unit = state._unit
    unit.training_state = TrainingState.POST_BACKWARD
    unit.ran_post_backward = True
    unit.reshard(ctx)
    # BACKWARD_POST issues the next all-gather as soon as this unit's parameters are freed and
    # before its reduce-scatter (as FSDP1), so the gather overlaps the reduction.
    if unit.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        _prefetch_backward(ctx, unit)
    if not state._sync_gradients:
        # no_sync(): keep accumulating the unsharded gradient; reduce at the next synced backward.
        if unit.use_orig_params:
            unit.handle.use_unsharded_grad_views(leaf.grad)
    else:
        unit.reduce_grad(ctx)
        if not unit.offload_params or ctx.streams.post_backward is None:
            unit.expose_grads()


@torch.no_grad()
def final_callback(ctx: RootContext) -> None:
    """Once per backward: wait for the reductions, then put every unit back to IDLE and sharded."""
    streams = ctx.streams
    if streams.post_backward is not None:
        current = torch.cuda.current_stream(ctx.device)
        current.wait_stream(streams.post_backward)
        current.wait_stream(streams.all_gather)
        if any(u._pending_cpu_grad is not None for u in ctx.units):
            # Offloaded gradients were copied device-to-host asynchronously; the CPU optimizer
            # reads them next.
            current.synchronize()
    for unit in ctx.units:
        if unit._pending_cpu_grad is not None:
            unit.finish_offloaded_grad()
            unit.expose_grads()
        if unit.view_state == ViewState.COMPUTE or (
            unit.sharded_state != ShardedState.SHARDED and not unit.aliased
        ):
            # Prefetched but unused, or not resharded in forward and given no gradient.
            unit.reshard(ctx)
        unit.reset_backward_flags()
    ctx.final_callback_queued = False
    ctx.exec_order.frozen = True
