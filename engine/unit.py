"""One sharded unit: its flat-parameter handle and the state of its communication.

A unit is what one ``FullyShardedDataParallel`` instance manages: one all-gather before compute,
one gradient reduction after backward. :class:`FsdpUnit` changes its unsharded buffer only
through :meth:`unshard` / :meth:`wait_unshard` / :meth:`reshard` (which assert the current
:class:`ShardedState`) and reduces gradients in :meth:`reduce_grad`. Its training state is its
instance's :class:`~engine.lifecycle.TrainingLifecycle` (one object, held by both), its settings
its instance's :class:`~engine.config.UnitConfig` (the handle's). Hooks and ordering live in
:mod:`engine.state`; communication in :mod:`engine.collectives`.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Callable

import torch
from torch import Tensor

from engine import collectives, comm_hooks
from engine.config import UnitConfig, skip_writeback_check
from engine.context import RootContext
from engine.flat_param import FlatParamHandle
from engine.lifecycle import TrainingLifecycle, TrainingState

__all__ = ["FsdpUnit", "ShardedState", "TrainingState", "ViewState", "offloaded_placement_error", "skip_writeback_check"]


class ShardedState(Enum):
    #: only the local shard exists; the unsharded leaf has no storage.
    SHARDED = auto()
    #: an all-gather into the leaf is in flight on the all-gather stream (CUDA only).
    UNSHARDING = auto()
    #: the leaf holds the full parameters, usable on the compute stream.
    UNSHARDED = auto()


class ViewState(Enum):
    """What the module attributes of the original parameters currently are."""

    #: original ``Parameter``s viewing the local shard (``use_orig_params``), or stale views.
    SHARDED = auto()
    #: plain ``Tensor`` views of the unsharded leaf, set for compute.
    COMPUTE = auto()


def offloaded_placement_error(
    offload_params: bool, found: torch.device, module_name: str, compute_device: torch.device
) -> str | None:
    """The error for a unit whose shard is on ``found``, or None where that is where it belongs.

    With parameter offload the shard lives on the CPU; a module moved off it after wrapping
    (``model.to("cuda")``) is refused at the next forward, as FSDP1 refuses it at its first,
    instead of training on silently with parameters where offload says they are not.
    """
    if not offload_params or found.type == "cpu":
        return None
    return (
        f"An FSDP-managed module with parameter CPU offloading enabled has parameters on {found} "
        f"(unit wrapping {module_name}): do not move the module from the CPU after wrapping it with "
        f"CPUOffload(offload_params=True); its parameters move to the compute device {compute_device} "
        "only for forward and backward"
    )


class FsdpUnit:
    """A handle plus the communication state around it."""

    def __init__(self, handle: FlatParamHandle, module_name: str, lifecycle: TrainingLifecycle | None = None) -> None:
        self.handle = handle
        #: the instance's configuration, shared with its module state and its handle.
        self.config: UnitConfig = handle.config
        #: class and position of the wrapped module, for error messages.
        self.module_name = module_name

        #: the training state of the instance this unit belongs to (its owner's object, shared).
        self.lifecycle = lifecycle if lifecycle is not None else TrainingLifecycle(module_name)
        self.sharded_state = ShardedState.SHARDED
        self.view_state = ViewState.SHARDED
        #: completion of the in-flight all-gather (CUDA); None when nothing is in flight.
        self._all_gather_event: torch.cuda.Event | None = None
        #: NO_SHARD computing in the parameter dtype on the parameter device: the leaf aliases
        #: the flat parameter, so there is nothing to gather or free.
        self.aliased = False
        #: per-backward flags, reset by the final callback.
        self.ran_pre_backward = False
        self.ran_post_backward = False
        #: offloaded gradient copied device-to-host on the post-backward stream, accumulated
        #: into ``flat_param.grad`` by the final callback once the copy is known complete.
        self._pending_cpu_grad: Tensor | None = None
        #: post-accumulate-grad hooks, one per compute leaf (a second leaf appears the first time
        #: full precision in eval is used).
        self._post_backward_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._post_backward_fn: Callable[[Tensor], None] | None = None
        #: ``register_comm_hook``: replaces the built-in gradient reduction (see engine.comm_hooks).
        self.comm_hook: Callable[..., None] | None = None
        self.comm_hook_state: object = None

    @property
    def training_state(self) -> TrainingState:
        return self.lifecycle.state

    # ------------------------------------------------------------------ lazy init
    @property
    def device(self) -> torch.device:
        return self.handle.device

    @torch.no_grad()
    def lazy_init(self, post_backward: Callable[[Tensor], None]) -> None:
        """Place the shard where it belongs and create the unsharded leaf (once)."""
        handle = self.handle
        flat = handle.flat_param
        if handle.unsharded_flat_param is not None:
            return
        self.check_offloaded_placement(original_params=True)
        target = torch.device("cpu") if self.config.offload_params else self.device
        pin = self.config.offload_params and self.device.type == "cuda"
        if flat.device != target or (pin and not flat.is_pinned()):
            if self.config.use_orig_params and not self.config.skip_writeback_check:
                # Adopt user edits made since construction before the shard's storage moves.
                handle.writeback_orig_params()
            # Module moved (or not) after wrapping (e.g. wrapped on CPU, then ``.cuda()`` not
            # called): put the shard where compute or the offload wants it. Pinned host memory
            # makes the host-to-device copies asynchronous.
            moved = flat.data.to(target)
            flat.data = moved.pin_memory() if pin else moved
            if flat.grad is not None:
                flat.grad.data = flat.grad.data.to(target)
            if self.config.use_orig_params:
                handle.use_sharded_views()
                handle.use_sharded_grad_views()
        self.aliased = not handle.uses_sharded_strategy and flat.dtype == handle.param_dtype and flat.device == self.device
        leaf = handle.init_unsharded_flat_param(alias_flat_param=self.aliased)
        if self.aliased:
            self.sharded_state = ShardedState.UNSHARDED
        self._post_backward_fn = post_backward
        self._hook_leaf(leaf)

    def check_offloaded_placement(self, original_params: bool = False) -> None:
        """Refuse a shard that parameter offload says is on the CPU but is not (see
        :func:`offloaded_placement_error`). ``original_params`` (at lazy init) checks the original
        parameters too: with ``use_orig_params`` they are what ``module.to()`` moves, as FSDP1 sees
        them at its first forward; later they legitimately show compute views between the hooks."""
        if not self.config.offload_params:
            return  # nothing to check (every root pre-forward asks every unit)
        found = self.handle.flat_param.device
        if original_params and self.config.use_orig_params and found.type == "cpu":
            moved = next((p.device for p in self.handle.orig_params if p.device.type != "cpu"), None)
            found = moved if moved is not None else found
        error = offloaded_placement_error(self.config.offload_params, found, self.module_name, self.device)
        if error is not None:
            raise RuntimeError(error)

    def _hook_leaf(self, leaf: Tensor) -> None:
        if leaf.requires_grad and self._post_backward_fn is not None:
            self._post_backward_hooks.append(leaf.register_post_accumulate_grad_hook(self._post_backward_fn))

    @property
    def _post_backward_hook(self) -> torch.utils.hooks.RemovableHandle | None:
        """The hook on the first compute leaf (None before lazy init or for a frozen unit)."""
        return self._post_backward_hooks[0] if self._post_backward_hooks else None

    # ------------------------------------------------------------------ precision
    @property
    def full_precision(self) -> bool:
        """True while this unit ignores its mixed precision ([Note: full precision in eval])."""
        return self.handle.force_full_precision

    def set_full_precision(self, full: bool) -> None:
        """Compute, gather and reduce in full precision from the next unshard on (or not).

        Only a resharded unit switches (its next all-gather is in the new dtype); a unit still
        holding unsharded parameters keeps its current precision.
        """
        if self.sharded_state != ShardedState.SHARDED and not self.aliased:
            return
        created = self.handle.set_full_precision(full)
        if created is not None:
            self._hook_leaf(created)

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, ctx: RootContext) -> None:
        """Issue the all-gather (or the cast copy for NO_SHARD) if the leaf is not unsharded."""
        if self.sharded_state != ShardedState.SHARDED:
            return
        handle = self.handle
        ctx.limiter.wait_if_needed()
        if handle.uses_sharded_strategy:
            result = collectives.all_gather_flat(
                handle.flat_param,
                handle.alloc_unsharded_flat_param,
                self.config.shard_group,
                ctx.streams.all_gather,
                self.device,
                handle.param_dtype,
            )
        else:
            result = collectives.copy_flat(
                handle.flat_param, handle.alloc_unsharded_flat_param, ctx.streams.all_gather
            )
        self._all_gather_event = result.event
        self.sharded_state = ShardedState.UNSHARDING if result.event is not None else ShardedState.UNSHARDED

    def wait_unshard(self) -> None:
        """Make the compute stream wait for the in-flight all-gather."""
        if self.sharded_state == ShardedState.UNSHARDING:
            assert self._all_gather_event is not None
            torch.cuda.current_stream(self.device).wait_event(self._all_gather_event)
            self._all_gather_event = None
            self.sharded_state = ShardedState.UNSHARDED
        if self.sharded_state != ShardedState.UNSHARDED:
            raise RuntimeError(f"{self.module_name}: wait_unshard() without unshard() (state {self.sharded_state})")

    def reshard(self, ctx: RootContext) -> None:
        """Free the unsharded buffer and point the original parameters back at the shard."""
        if self.sharded_state == ShardedState.UNSHARDING:
            self.wait_unshard()
        if not self.aliased and self.sharded_state == ShardedState.UNSHARDED:
            leaf = self.handle.unsharded_flat_param
            if self.device.type == "cuda" and leaf is not None:
                # Allocated on the all-gather stream, used on the compute stream: the allocator
                # must not reuse it before compute is done.
                leaf.record_stream(torch.cuda.current_stream(self.device))
            self.handle.free_unsharded_flat_param()
            ctx.limiter.record_free(self.device)
            self.sharded_state = ShardedState.SHARDED
        self.use_sharded_views()

    def use_sharded_views(self) -> None:
        if self.config.use_orig_params:
            self.handle.use_sharded_views()
        self.view_state = ViewState.SHARDED

    def use_compute_views(self) -> None:
        # torch FSDP1's name for the switch: PyTorch's FSDP tests (the ported tests) patch it on
        # the handle class of either engine.
        self.handle._use_unsharded_views(as_params=False)
        self.view_state = ViewState.COMPUTE

    # ------------------------------------------------------------------ writeback
    def check_no_change_since_forward(self) -> None:
        """Between forward and backward of a unit that was not resharded, the original
        parameters must be the compute views forward used (their saved tensors are what
        backward differentiates)."""
        if self.view_state != ViewState.COMPUTE or not self.config.use_orig_params or self.config.skip_writeback_check:
            return
        changed = self.handle.compute_views_changed()
        if changed:
            raise AssertionError(
                "FSDP does not support changing the parameters between forward and backward for "
                f"{self.config.strategy}: {', '.join(changed)} of {self.module_name} changed; change "
                "parameters before forward or after backward (or use FULL_SHARD)"
            )

    def writeback(self) -> bool:
        """Adopt user changes to the sharded original parameters and gradients (``use_orig_params``)."""
        if not self.config.use_orig_params:
            return False
        leaf = self.handle.unsharded_flat_param
        # Under no_sync() the original gradients view the unsharded accumulated gradient.
        pending_unsharded_grad = leaf is not None and leaf.grad is not None
        # With compute views registered (between forward and backward) only gradients can be
        # checked; parameter changes there are an error (check_no_change_since_forward).
        check_params = self.view_state == ViewState.SHARDED
        if self.config.skip_writeback_check:
            return not pending_unsharded_grad and self.handle.reset_flat_grad_if_all_none()
        if pending_unsharded_grad and not check_params:
            return False
        wrote = self.handle.writeback_orig_params(check_grads=not pending_unsharded_grad, check_params=check_params)
        if wrote.params:
            self.reshard_stale()
        return wrote.params or wrote.grads

    def reshard_stale(self) -> None:
        """Drop an unsharded copy made before the shard changed (the next unshard re-gathers)."""
        if self.sharded_state == ShardedState.UNSHARDING:
            self.wait_unshard()
        if self.sharded_state == ShardedState.UNSHARDED and not self.aliased:
            self.handle.free_unsharded_flat_param()
            self.sharded_state = ShardedState.SHARDED

    # ------------------------------------------------------------------ gradients
    def reduce_grad(self, ctx: RootContext) -> None:
        """Average the unsharded gradient over the data-parallel ranks into ``flat_param.grad``.

        The unsharded gradient is released; the reduced one is accumulated into an existing
        sharded gradient (accumulation across iterations without ``zero_grad``).
        """
        handle = self.handle
        leaf = handle.unsharded_flat_param
        assert leaf is not None and leaf.grad is not None
        unsharded_grad = leaf.grad
        # Cleared before the (asynchronous) reduction so a following backward starts a fresh
        # gradient instead of adding into one being reduced.
        leaf.grad = None
        stream = ctx.streams.post_backward
        if self.comm_hook is not None:
            result = comm_hooks.run_comm_hook(
                self.comm_hook,
                self.comm_hook_state,
                unsharded_grad,
                handle.reduce_dtype,
                handle.uses_sharded_strategy,
                handle.world_size,
                stream,
            )
        elif handle.uses_sharded_strategy:
            result = collectives.reduce_scatter_grad(
                unsharded_grad, self.config.shard_group, self.config.replicate_group, handle.reduce_dtype, stream
            )
        else:
            result = collectives.all_reduce_grad(unsharded_grad, self.config.shard_group, handle.reduce_dtype, stream)
        del unsharded_grad
        with collectives.stream_context(stream):
            self._accumulate(result.grad)

    def _accumulate(self, reduced: Tensor) -> None:
        """Runs on the post-backward stream (CUDA) right after the reduction."""
        flat = self.handle.flat_param
        grad_dtype = self.handle.param_dtype if self.config.keep_low_precision_grads else flat.dtype
        reduced = reduced.to(grad_dtype)
        # Sliced only when the reduced chunk is longer than the shard (a reduce-scatter's is the shard's size).
        if self.handle.uses_sharded_strategy and reduced.numel() != flat.numel():
            reduced = reduced[: flat.numel()]
        if self.config.offload_params and reduced.device.type != "cpu":
            host = torch.empty(reduced.shape, dtype=reduced.dtype, device="cpu", pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            # One reduction per unit per backward: the final callback consumes it before the next.
            assert self._pending_cpu_grad is None, f"{self.module_name}: offloaded gradient not consumed"
            self._pending_cpu_grad = host
            return
        self._set_or_add_grad(reduced)

    def _set_or_add_grad(self, grad: Tensor) -> None:
        flat = self.handle.flat_param
        if flat.grad is None:
            if grad.dtype != flat.dtype or grad.device != flat.device:
                # ``.grad =`` insists on the parameter's dtype and device; low-precision or
                # device-resident gradients go in through ``.data``.
                flat.grad = torch.empty_like(flat)
                flat.grad.data = grad
            else:
                flat.grad = grad
        else:
            if flat.grad.shape != grad.shape:
                raise RuntimeError(
                    f"{self.module_name}: existing gradient of shape {tuple(flat.grad.shape)} cannot "
                    f"accumulate a reduced gradient of shape {tuple(grad.shape)}; zero the gradients "
                    "(optimizer.zero_grad()) after changing the sharding"
                )
            if flat.grad.dtype == grad.dtype == flat.dtype:
                flat.grad += grad
            else:
                # A low-precision gradient (keep_low_precision_grads): FSDP1 accumulates in the
                # parameter dtype and rounds the sum once to the dtype of the newest gradient.
                total = flat.grad.to(flat.dtype) + grad.to(flat.dtype)
                flat.grad.data = total.to(grad.dtype)

    def finish_offloaded_grad(self) -> None:
        """Accumulate the offloaded gradient (the caller has synchronized the device)."""
        if self._pending_cpu_grad is not None:
            grad, self._pending_cpu_grad = self._pending_cpu_grad, None
            self._set_or_add_grad(grad)

    def expose_grads(self) -> None:
        """With ``use_orig_params``, point the original parameters' ``.grad`` at ``flat_param.grad``."""
        if self.config.use_orig_params:
            self.handle.use_sharded_grad_views()

    def reset_backward_flags(self) -> None:
        self.ran_pre_backward = False
        self.ran_post_backward = False

    def __repr__(self) -> str:
        return f"FsdpUnit({self.module_name}, {self.config.strategy.name}, {self.sharded_state.name})"
