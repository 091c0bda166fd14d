"""``summon_full_params``: full-precision, unsharded ``nn.Parameter``s for inspection or edits.

Each unit gathers its flat parameter in full precision into a temporary buffer (never the
compute leaf, which may be in the low-precision dtype and may be in use by a pending backward),
registers the original parameters as ``nn.Parameter`` views of it, and on exit writes this
rank's part back into the shard (``writeback=True``) and restores whatever the module attributes
were before: sharded views, or the compute views a pending backward expects.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from engine import collectives
from engine.module_tree import is_fsdp
from engine.param_views import _flat_view, same_storage
from engine.state import ModuleState
from engine.unit import FsdpUnit, ShardedState, ViewState

__all__ = ["summon_full_params"]

_FLAT_PARAM = "_flat_param"


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported: other ranks have "
            "nothing to write back from; pass writeback=False"
        )
    wrappers = [m for m in module.modules() if is_fsdp(m)]
    if not wrappers:
        yield
        return
    if not recurse:
        inside: set[int] = set()
        top = []
        for w in wrappers:
            if id(w) not in inside:
                top.append(w)
                inside.update(id(sub) for sub in w.modules())
        wrappers = top
    states: list[ModuleState] = [w._fsdp_state for w in wrappers]
    for s in states:
        if s.is_root is None:
            s.lazy_init()
    if offload_to_cpu:
        _check_offload_to_cpu(states)
    for s in states:
        if not s.lifecycle.idle:
            raise RuntimeError(
                f"summon_full_params cannot be entered during forward or backward or while already "
                f"summoned (unit wrapping {s.lifecycle.owner} is {s.lifecycle.state.name}): call it "
                "between iterations"
            )
    with contextlib.ExitStack() as stack:
        for s in states:
            stack.enter_context(_summon_state(s, writeback, rank0_only, offload_to_cpu, with_grads))
        yield


def _check_offload_to_cpu(states: list[ModuleState]) -> None:
    """FSDP1 refuses ``offload_to_cpu=True`` for a unit that does not shard (NO_SHARD, or any
    non-hybrid strategy on a one-rank group), before anything is gathered; so does ours."""
    for s in states:
        unit = s.unit
        if unit is not None and not unit.handle.uses_sharded_strategy:
            raise NotImplementedError(
                f"offload_to_cpu=True and NO_SHARD is not supported yet: the unit wrapping "
                f"{type(s.module).__name__} does not shard (NO_SHARD, or one rank in its process group), so "
                "summon_full_params has no gathered copy to place on the CPU; pass offload_to_cpu=False "
                "(its full parameters are its local ones) or shard it over more than one rank"
            )


def _gather_full(unit: FsdpUnit, flat: Tensor, to_cpu: bool) -> Tensor:
    """The unsharded (padded) flat tensor in ``flat``'s dtype, on the CPU when ``to_cpu``, else
    on the compute device (for every strategy and with CPU offload too, as FSDP1's). NO_SHARD
    returns ``flat`` itself where it already lives there (edits then land in it directly)."""
    handle = unit.handle
    target = torch.device("cpu") if to_cpu else unit.device
    if not handle.uses_sharded_strategy:
        return flat if flat.device == target else flat.to(target)
    out = torch.empty(handle.layout.padded_unsharded_numel, dtype=flat.dtype, device=unit.device)
    collectives.all_gather_flat(flat, lambda: out, unit.config.shard_group, None, unit.device, flat.dtype)
    return out.cpu() if to_cpu and out.device.type != "cpu" else out


@contextlib.contextmanager
def _summon_state(
    state: ModuleState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    unit = state.unit
    if unit is None:
        with state.lifecycle.summoning():
            yield
        return
    handle = unit.handle
    flat = handle.flat_param
    with state.lifecycle.summoning():
        with torch.no_grad():
            unit.writeback()
            prior_views = unit.view_state
            snapshot = _snapshot_attrs(handle)
            full = _gather_full(unit, flat.data, offload_to_cpu)
            full_grad = None
            if with_grads:
                grad = flat.grad if flat.grad is not None else torch.zeros_like(flat)
                full_grad = _gather_full(unit, grad.data, offload_to_cpu)
            show = not rank0_only or dist.get_rank() == 0
            wrapped = state.module
            flat_registered = wrapped._parameters.pop(_FLAT_PARAM, None)
            if show:
                handle.use_unsharded_views(as_params=True, source=full)
                if full_grad is not None:
                    for param, view in zip(_registered_params(handle), handle.unflat_views(full_grad)):
                        param.grad = view if param.requires_grad else None
        try:
            yield
        finally:
            with torch.no_grad():
                if show and writeback:
                    _write_back(unit, full)
                if flat_registered is not None:
                    wrapped._parameters[_FLAT_PARAM] = flat_registered
                _restore_views(unit, prior_views, snapshot)


def _registered_params(handle) -> list[nn.Parameter]:
    return [info.module._parameters[info.param_name] for info in handle.param_infos]


def _write_back(unit: FsdpUnit, full: Tensor) -> None:
    """Copy edits made inside the context into this rank's shard."""
    handle = unit.handle
    for param, start, entry in zip(_registered_params(handle), handle.layout.param_offsets(), handle.layout.params):
        if param.numel() > 0 and not same_storage(param, full):
            # ``.data`` (or the Parameter) was replaced inside the context.
            if tuple(param.shape) != entry.shape:
                raise RuntimeError(
                    f"Cannot writeback when the parameter shape changes\nExpects {torch.Size(entry.shape)} "
                    f"but got {param.shape} for {entry.fqn}"
                )
            full.narrow(0, start, entry.numel).copy_(_flat_view(param))
    flat = handle.flat_param
    if handle.uses_sharded_strategy:
        start, _, _ = handle.layout.shard_bounds(handle.rank)
        flat.data.copy_(full[start : start + flat.numel()])
    elif not same_storage(full, flat):
        flat.data.copy_(full[: flat.numel()])
    if not unit.aliased and unit.sharded_state != ShardedState.SHARDED and unit.view_state == ViewState.SHARDED:
        # A prefetched unsharded copy is stale now; the next unshard gathers the edits. (With
        # compute views a pending backward still needs the copy its forward used.)
        unit.reshard_stale()


def _snapshot_attrs(handle) -> list[tuple[nn.Module, str, bool, object]]:
    """``(module, name, registered as parameter, object)`` of every original parameter attribute."""
    infos = [(i.module, i.param_name) for i in (*handle.param_infos, *handle.shared_param_infos)]
    out = []
    for module, name in infos:
        if name in module._parameters:
            out.append((module, name, True, module._parameters[name]))
        else:
            out.append((module, name, False, module.__dict__.get(name)))
    return out


def _restore_views(unit: FsdpUnit, prior: ViewState, snapshot: list[tuple[nn.Module, str, bool, object]]) -> None:
    handle = unit.handle
    if prior == ViewState.SHARDED and handle.config.use_orig_params:
        handle.use_sharded_views()
        return
    # Compute views a pending backward expects, or (use_orig_params=False) the plain attributes
    # viewing the leaf: put the very same objects back.
    for module, name, as_param, obj in snapshot:
        module._parameters.pop(name, None)
        module.__dict__.pop(name, None)
        if as_param:
            module._parameters[name] = obj
        elif obj is not None:
            module.__dict__[name] = obj
