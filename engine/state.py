"""One FSDP instance's module state and the hooks that drive its unit through an iteration.

The public wrapper (``FullyShardedDataParallel``) is thin: it owns one :class:`ModuleState` and
calls its hooks from ``forward``. The state knows its wrapper only as an ``nn.Module`` (for its
tree and its ``training`` flag); nothing here imports the wrapper. Per iteration, for each
instance:

1. root pre-forward (:meth:`ModuleState.root_pre_forward`): lazily create the shared context,
   put back any unit still unsharded from a forward that had no backward, mark every unit's user
   changes to original parameters as still to adopt (writeback), move and cast the inputs;
2. pre-forward (:meth:`ModuleState.pre_forward`): adopt the unit's user changes, all-gather into the
   unsharded leaf, register compute views, prefetch the next unit's all-gather (``forward_prefetch``,
   after adopting that unit's changes);
3. post-forward (:meth:`ModuleState.post_forward`): free the unsharded parameters
   (FULL_SHARD/HYBRID_SHARD, except the root, whose parameters backward needs first), register the
   pre-backward hook on every output tensor that requires grad;
4. pre-backward (:meth:`ModuleState.pre_backward`, on the outputs' gradients): the first one of a
   backward queues the final callback; re-gather the unit, prefetch the next (BACKWARD_PRE);
5. post-backward (:meth:`ModuleState.post_backward`, after the gradient accumulates into the
   unsharded leaf): free the unsharded parameters, reduce the gradient (unless in ``no_sync()``),
   prefetch the next (BACKWARD_POST);
6. final callback (:meth:`ModuleState.finish_backward` of the root, once the whole backward is
   done): wait for every reduction, finish offloaded gradients, reshard units whose post-backward
   never ran, reset.

Training-state changes go through the instance's :class:`~engine.lifecycle.TrainingLifecycle`.

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

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves, tree_map_only

from engine.api import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    StateDictSettings,
    StateDictType,
)
from engine.config import UnitConfig
from engine.context import AllGatherLimiter, RootContext, Streams
from engine.dynamo import outside_dynamo
from engine.lifecycle import TrainingLifecycle, TrainingState
from engine.module_tree import is_fsdp, managed_buffers
from engine.precision import BufferPrecision, BufferState, cast_floating_tensors
from engine.unit import FsdpUnit, ShardedState, ViewState

__all__ = ["ModuleState", "fsdp_states"]


def fsdp_states(module: nn.Module) -> list["ModuleState"]:
    """The module state of every FSDP instance in ``module``'s tree, in module order."""
    return [m._fsdp_state for m in module.modules() if is_fsdp(m)]


def _move_inputs(args: Any, kwargs: Any, device: torch.device) -> tuple[Any, Any]:
    def move(t: Tensor) -> Tensor:
        return t.to(device) if t.device != device else t

    return tree_map_only(Tensor, move, (args, kwargs))


class ModuleState:
    """What one FSDP instance is below its public wrapper: its unit, settings and hooks."""

    def __init__(
        self,
        wrapper: nn.Module,
        module: nn.Module,
        config: UnitConfig,
        unit: FsdpUnit | None,
        lifecycle: TrainingLifecycle,
        ignored_modules: set[nn.Module],
    ) -> None:
        #: the public wrapper, as a module: its tree and its ``training`` flag.
        self.wrapper = wrapper
        #: the wrapped module.
        self.module = module
        #: this instance's configuration (its unit and handle hold the same object).
        self.config = config
        #: None for an instance with no parameters of its own.
        self.unit = unit
        #: the one owner of this instance's training state (the unit holds the same object).
        self.lifecycle = lifecycle
        self.ignored_modules = ignored_modules
        #: which state dict ``state_dict()`` produces (set for the whole tree by ``set_state_dict_type``).
        self.state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        #: None until the first forward (or utility) decides; then whether this is the root.
        self.is_root: bool | None = None
        #: shared with every instance of the root's tree at lazy init.
        self.ctx: RootContext | None = None
        #: False inside ``no_sync()``: gradients accumulate unsharded.
        self.sync_gradients = True
        #: root only: every instance of its tree (itself first), those without parameters too.
        self.tree: list[ModuleState] = []

    @property
    def rank(self) -> int:
        return self.config.shard_group.rank()

    @property
    def world_size(self) -> int:
        return self.config.shard_group.size()

    # ------------------------------------------------------------------ lazy init
    @outside_dynamo
    def lazy_init(self) -> None:
        """Make this instance the root of every instance in its tree and create their context."""
        if self.is_root is not None:
            return
        states = fsdp_states(self.wrapper)
        for state in states[1:]:
            # An instance whose forward ran alone first made itself a root; it is nested now.
            state.is_root = False
        self.is_root = True
        self.tree = states
        device = self.config.compute_device
        ctx = RootContext(
            device=device,
            streams=Streams.for_device(device),
            limiter=AllGatherLimiter(enabled=self.config.limit_all_gathers and device.type == "cuda"),
            units=[s.unit for s in states if s.unit is not None],
            finish_backward=self.finish_backward,
        )
        for state in states:
            state.ctx = ctx
            if state.unit is not None:
                state.unit.lazy_init(state.post_backward)
        ctx.buffers = self._buffer_precision(device)
        ctx.buffers.to_compute()

    def _buffer_precision(self, device: torch.device) -> BufferPrecision:
        """Each instance's buffers with its ``buffer_dtype``, innermost first (its setting wins)."""
        ignored: set[nn.Module] = set()
        for state in self.tree:
            ignored |= state.ignored_modules
        owned = []
        for state in reversed(self.tree):
            mp = state.config.mixed_precision
            owned.append((managed_buffers(state.module, ignored), mp.buffer_dtype if mp is not None else None))
        return BufferPrecision(owned, device)

    def _select_precision(self) -> None:
        """Decide this iteration's precision per unit and put the buffers in the matching dtype.

        See [Note: full precision in eval] in :mod:`engine.precision`.
        """
        ctx = self.ctx
        any_full = False
        for state in self.tree:
            unit = state.unit
            if unit is None:
                continue
            full = state.config.use_full_prec_in_eval and not state.module.training
            # Only a change is passed on (the root's lead-in before the first all-gather runs this for every
            # unit): asking for the precision a unit already has is a no-op, which it would find out slower.
            if full != unit.full_precision:
                unit.set_full_precision(full)
            any_full = any_full or unit.full_precision
        buffers = ctx.buffers
        if buffers is None:
            return
        if any_full:
            if buffers.state != BufferState.ORIGINAL:
                buffers.to_original()
        elif buffers.state != BufferState.COMPUTE:
            buffers.to_compute()

    # ------------------------------------------------------------------ forward
    @outside_dynamo
    def root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        ctx = self.ctx
        ctx.forward_count += 1
        if ctx.forward_count >= 2:
            ctx.exec_order.frozen = True
        if all(s.lifecycle.idle for s in self.tree):
            for unit in ctx.units:
                unit.check_offloaded_placement()
            for unit in ctx.units:
                if unit.view_state == ViewState.COMPUTE or (
                    unit.sharded_state != ShardedState.SHARDED and not unit.aliased
                ):
                    # Unsharded by a forward that had no backward (eval, or SHARD_GRAD_OP): the
                    # optimizer or the user may have changed the shard since.
                    unit.reshard(ctx)
            # Adopting user changes to the original parameters waits for each unit's first all-gather of
            # this forward (``_write_back_pending``): here, before the root's, it held back the step's
            # first collective by every unit's check (torch FSDP1 checks them all here).
            ctx.writeback_pending = set(ctx.units)
            self._select_precision()
        # The optimizer step wrote shards on the compute stream (a unit's writeback, if it writes, waits again).
        ctx.streams.gather_after_compute()
        args, kwargs = _move_inputs(args, kwargs, ctx.device)
        mp = self.config.mixed_precision
        # Root inputs follow the root's training flag even when the root has no parameters (FSDP1).
        full_precision = self.config.use_full_prec_in_eval and not self.wrapper.training
        if mp is not None and mp.cast_root_forward_inputs and not full_precision:
            args, kwargs = cast_floating_tensors((args, kwargs), mp.param_dtype)
        return args, kwargs

    @outside_dynamo
    def pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self._recomputing():
            return args, kwargs
        mp = self.config.mixed_precision
        unit = self.unit
        # Only units with parameters cast (FSDP1): a parameterless unit has nothing to match.
        if unit is not None and not unit.full_precision and mp is not None and mp.cast_forward_inputs:
            args, kwargs = cast_floating_tensors((args, kwargs), mp.param_dtype)
        if unit is None:
            return args, kwargs
        ctx = self.ctx
        self.lifecycle.to_forward()
        ctx.exec_order.record_pre_forward(unit)
        self._write_back_pending(unit)
        unit.unshard(ctx)
        unit.wait_unshard()
        unit.use_compute_views()
        if unit.config.forward_prefetch:
            self._prefetch(ctx.exec_order.next_forward(unit))
        return args, kwargs

    @outside_dynamo
    def post_forward(self, output: Any) -> Any:
        if self._recomputing():
            return output
        unit = self.unit
        grad_enabled = torch.is_grad_enabled()
        if unit is not None:
            ctx = self.ctx
            ctx.exec_order.record_post_forward(unit)
            # As FSDP1's: units that reshard after forward free here, the root excepted (backward
            # needs its parameters first). Without grad too: a reentrant checkpoint's first forward
            # runs without grad and its recomputation in backward finds SHARD_GRAD_OP's parameters
            # still unsharded, as torch FSDP1's (freeing them would gather them again).
            free = unit.handle.uses_sharded_strategy and unit.config.reshard_after_forward and not self.is_root
            if free:
                unit.reshard(ctx)
            elif unit.config.use_orig_params and not (grad_enabled and unit.config.sharded and not unit.config.reshard_after_forward):
                # Kept unsharded for backward (the root, NO_SHARD): the original parameters still
                # show the shard between forward and backward, as FSDP1's; with CPU offload that
                # is the CPU. SHARD_GRAD_OP keeps the compute views, which backward must find
                # unchanged.
                unit.use_sharded_views()
            self.lifecycle.forward_done()
        if grad_enabled:
            for t in tree_leaves(output):
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(self.pre_backward)
        return output

    def _recomputing(self) -> bool:
        """Whether this forward is activation checkpointing recomputing the unit inside its backward,
        after its pre-backward unsharded it: as FSDP1's, the forward hooks then do nothing (the
        inputs were saved cast, the parameters are unsharded, and a non-reentrant recomputation may
        stop before the post-forward runs)."""
        return self.unit is not None and self.lifecycle.state == TrainingState.PRE_BACKWARD

    def _prefetch(self, unit: FsdpUnit | None) -> None:
        if unit is None or unit.sharded_state != ShardedState.SHARDED:
            return
        self._write_back_pending(unit)
        unit.unshard(self.ctx)

    def _write_back_pending(self, unit: FsdpUnit) -> None:
        """Adopt user changes to ``unit``'s original parameters (``use_orig_params``) if this forward has not
        yet: before its first all-gather, and on the compute stream, which the all-gathers then wait for."""
        ctx = self.ctx
        if unit in ctx.writeback_pending:
            ctx.writeback_pending.discard(unit)
            if unit.writeback():
                ctx.streams.gather_after_compute()

    def _prefetch_backward(self, unit: FsdpUnit) -> None:
        target = self.ctx.exec_order.next_backward(unit)
        # Frozen units are prefetched too: their parameters are still needed in backward to carry
        # the gradient to their inputs (LoRA bases). One whose backward never runs is resharded by
        # the final callback.
        if target is None or target.ran_post_backward or target.handle.unsharded_flat_param is None:
            return
        self._prefetch(target)

    # ------------------------------------------------------------------ backward
    def pre_backward(self, grad: Tensor) -> None:
        ctx = self.ctx
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            Variable._execution_engine.queue_callback(ctx.finish_backward)
        unit = self.unit
        if unit is None or unit.ran_pre_backward:
            return None
        unit.ran_pre_backward = True
        self.lifecycle.to_pre_backward()
        unit.check_no_change_since_forward()
        ctx.writeback_pending.discard(unit)  # written back here
        if unit.writeback():
            ctx.streams.gather_after_compute()
        unit.unshard(ctx)
        unit.wait_unshard()
        if unit.config.use_orig_params and unit.view_state != ViewState.COMPUTE:
            # Backward computes with the unsharded parameters: the original parameters show them
            # (on the compute device) until the post-backward reshard, as FSDP1's. A unit that kept
            # forward's views (SHARD_GRAD_OP: unchanged, as checked above unless the check is
            # skipped) keeps them, as torch FSDP1 skips this switch when it skipped the post-forward
            # one (``_skipped_use_sharded_views``); making them again cost a view op per parameter.
            unit.use_compute_views()
        if unit.config.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward(unit)
        return None

    @torch.no_grad()
    def post_backward(self, leaf: Tensor) -> None:
        ctx = self.ctx
        unit = self.unit
        self.lifecycle.to_post_backward()
        unit.ran_post_backward = True
        unit.reshard(ctx)
        # BACKWARD_POST issues the next all-gather as soon as this unit's parameters are freed and
        # before its reduce-scatter (as FSDP1), so the gather overlaps the reduction.
        if unit.config.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            self._prefetch_backward(unit)
        if not self.sync_gradients:
            # no_sync(): keep accumulating the unsharded gradient; reduce at the next synced backward.
            if unit.config.use_orig_params:
                unit.handle.use_unsharded_grad_views(leaf.grad)
        else:
            unit.reduce_grad(ctx)
            if not unit.config.offload_params or ctx.streams.post_backward is None:
                unit.expose_grads()

    @torch.no_grad()
    def finish_backward(self) -> None:
        """The root's final callback, once per backward: wait for the reductions, then put every
        unit back to IDLE and sharded."""
        ctx = self.ctx
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
        for state in self.tree:
            state.lifecycle.backward_done()
        ctx.final_callback_queued = False
        ctx.exec_order.frozen = True

