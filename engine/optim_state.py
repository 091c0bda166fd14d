"""Optimizer state dicts of the engine, keyed by clean parameter names as torch FSDP1's.

:func:`consolidate` turns an optimizer's own state (keyed by position, over flat parameters or
over the sharded original parameters of ``use_orig_params``) into per-parameter state keyed by
clean FQN: full tensors in the original shapes (``FULL_STATE_DICT``) or ``DTensor`` chunks over the
shard group (``SHARDED_STATE_DICT``; ``LOCAL_STATE_DICT`` is treated the same, as torch FSDP1 does).
Zero-dimensional and non-tensor entries (Adam's ``step``, hyperparameter-like values) are copied
per parameter. :func:`flatten_for_load` is the inverse: per-parameter state back into the layout
the optimizer steps, keyed by position, ready for ``optim.load_state_dict``; it checks the whole dict
(names, groups, shapes, type) before converting anything, and converting changes nothing.

Tensor states are gathered per unit with the unit's flat layout, so everything here is a collective
over each unit's shard group (plus one metadata exchange per unit): call it on every rank.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from engine.api import StateDictType
from engine.dtensors import full_tensor
from engine.flat_param import FlatParameter
from engine.flat_state import chunk_dtensor, compose_shard, full_tensors, mesh_for, shard_piece, write_param
from engine.module_tree import is_fsdp
from engine.state import ModuleState, fsdp_states
from engine.state_dict_config import clean_fqn, get_state_dict_type

__all__ = ["ParamRef", "consolidate", "flatten_for_load", "optim_settings", "param_refs"]


class ParamRef(NamedTuple):
    """One parameter the optimizer steps and the original parameters it stands for."""

    param: Tensor
    #: clean names, one per original parameter (a flat parameter stands for all of its unit's).
    fqns: tuple[str, ...]
    #: the module state of the instance that manages it; None for a parameter no unit manages
    #: (ignored modules).
    state: ModuleState | None
    #: indices of those original parameters in the unit's handle.
    indices: tuple[int, ...]
    #: True: the optimizer steps the flat parameter (``use_orig_params=False``).
    flat: bool
    #: the name ``model.named_parameters()`` gives it (what a named optimizer keys by).
    raw_name: str


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def param_refs(model: nn.Module) -> dict[int, ParamRef]:
    """Every parameter of ``model`` an optimizer can hold, by ``id``."""
    raw = {id(p): n for n, p in model.named_parameters()}
    refs: dict[int, ParamRef] = {}
    for name, module in model.named_modules():
        if not is_fsdp(module) or module._fsdp_state.unit is None:
            continue
        state = module._fsdp_state
        handle = state.unit.handle
        prefix = clean_fqn(name)
        fqns = [clean_fqn(_join(prefix, e.fqn)) for e in handle.layout.params]
        if handle.config.use_orig_params:
            for i, p in enumerate(handle.orig_params):
                refs[id(p)] = ParamRef(p, (fqns[i],), state, (i,), False, raw.get(id(p), fqns[i]))
        else:
            flat = handle.flat_param
            refs[id(flat)] = ParamRef(flat, tuple(fqns), state, tuple(range(len(fqns))), True, raw.get(id(flat), ""))
    for name, p in model.named_parameters():
        if id(p) not in refs and not isinstance(p, FlatParameter):
            refs[id(p)] = ParamRef(p, (clean_fqn(name),), None, (), False, name)
    return refs


def _optim_params(optim: torch.optim.Optimizer, refs: dict[int, ParamRef]) -> list[ParamRef]:
    out = []
    for g, group in enumerate(optim.param_groups):
        for p in group["params"]:
            if id(p) not in refs:
                raise ValueError(
                    f"The optimizer's param group {g} holds a parameter of shape {tuple(p.shape)} that is not "
                    "a parameter of the model: build the optimizer over the wrapped model's parameters"
                )
            out.append(refs[id(p)])
    return out


def optim_settings(model: nn.Module) -> tuple[bool, bool, bool]:
    """``(full, rank0_only, offload_to_cpu)`` from the model's state-dict settings."""
    settings = get_state_dict_type(model)
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    config = settings.optim_state_dict_config
    return full, full and getattr(config, "rank0_only", False), getattr(config, "offload_to_cpu", True)


def _is_sharded_tensor_state(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


# ------------------------------------------------------------------------------------ consolidate
def _unit_state(unit_state: ModuleState, refs: list[tuple[int, ParamRef]], osd_state: Mapping[Any, Any], full: bool) -> dict[str, dict[str, Any]]:
    """Per clean FQN, the consolidated state of one unit's parameters (collective over its group)."""
    unit = unit_state.unit
    handle = unit.handle
    n = len(handle.layout.params)
    fqn_of = {i: ref.fqns[k] for _, ref in refs for k, i in enumerate(ref.indices)}
    # Per original parameter: its local state (flat states stand for every parameter of the unit).
    local: dict[int, Mapping[str, Any]] = {}
    for key, ref in refs:
        st = osd_state.get(key)
        if st:
            for i in ref.indices:
                local[i] = st
    # What every rank holds: tensor keys with their dtype, and each parameter's key order and scalars.
    meta = {
        i: (list(st), {k: v for k, v in st.items() if not _is_sharded_tensor_state(v)},
            {k: v.dtype for k, v in st.items() if _is_sharded_tensor_state(v)})
        for i, st in local.items()
    }
    if handle.uses_sharded_strategy:
        gathered: list[Any] = [None] * unit.config.shard_group.size()
        dist.all_gather_object(gathered, meta, group=unit.config.shard_group)
    else:
        gathered = [meta]
    merged: dict[int, tuple[list[str], dict[str, Any], dict[str, torch.dtype]]] = {}
    for rank_meta in gathered:
        for i, (order, scalars, dtypes) in rank_meta.items():
            if i not in merged:
                merged[i] = (order, scalars, dict(dtypes))
            else:
                merged[i][2].update(dtypes)
    tensor_keys: dict[str, torch.dtype] = {}
    for i in sorted(merged):
        tensor_keys.update(merged[i][2])
    flat = handle.flat_param
    full_values: dict[str, list[Tensor]] = {}
    for key in sorted(tensor_keys):
        like = torch.empty(0, dtype=tensor_keys[key], device=flat.device)
        if refs[0][1].flat:
            st = local.get(0)
            shard = st[key] if st is not None and key in st else torch.zeros(flat.numel(), dtype=like.dtype, device=like.device)
        else:
            pieces = [local[i][key] if i in local and key in local[i] else None for i in range(n)]
            shard = compose_shard(handle, pieces, like)
        full_values[key] = full_tensors(unit, shard.reshape(-1) if refs[0][1].flat else shard)
    mesh = mesh_for(unit_state) if handle.uses_sharded_strategy and not full else None
    out: dict[str, dict[str, Any]] = {}
    for i in range(n):
        if i not in merged or i not in fqn_of:
            continue
        order, scalars, dtypes = merged[i]
        entry: dict[str, Any] = {}
        # Tensor states first, then zero-dimensional and other values (torch FSDP1's order).
        for key in sorted(order, key=lambda k: k not in dtypes):
            if key in dtypes:
                value = full_values[key][i]
                entry[key] = chunk_dtensor(value, mesh) if mesh is not None else value
            else:
                entry[key] = copy.deepcopy(scalars[key])
        out[fqn_of[i]] = entry
    return out


@torch.no_grad()
def consolidate(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: Mapping[str, Any],
    full: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``osd`` (the optimizer's own state dict) keyed by clean FQN, full or sharded per parameter."""
    refs = param_refs(model)
    params = _optim_params(optim, refs)
    osd_state = osd["state"]
    by_unit: dict[int, list[tuple[int, ParamRef]]] = {}
    state: dict[str, Any] = {}
    for key, ref in enumerate(params):
        if ref.state is None:
            if key in osd_state:
                state[ref.fqns[0]] = {k: (full_tensor(v).clone() if isinstance(v, Tensor) else copy.deepcopy(v)) for k, v in osd_state[key].items()}
        else:
            by_unit.setdefault(id(ref.state), []).append((key, ref))
    for unit_state in fsdp_states(model):
        if id(unit_state) in by_unit:
            state.update(_unit_state(unit_state, by_unit[id(unit_state)], osd_state, full))
    if rank0_only and dist.get_rank(group) != 0:
        return {}
    if offload_to_cpu:
        state = {f: {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in st.items()} for f, st in state.items()}
    order = {f: n for n, ref in enumerate(params) for f in ref.fqns}
    groups = []
    for group_sd in osd["param_groups"]:
        g = {k: copy.deepcopy(v) for k, v in group_sd.items() if k != "params"}
        g["params"] = [f for idx in group_sd["params"] for f in params[idx].fqns]
        groups.append(g)
    return {"state": dict(sorted(state.items(), key=lambda kv: order.get(kv[0], len(order)))), "param_groups": groups}


# ----------------------------------------------------------------------------------------- load
def _check_osd(
    model: nn.Module, optim: torch.optim.Optimizer, osd: Any, params: list[ParamRef], full: bool
) -> None:
    """Everything that can be wrong with a per-FQN optimizer state dict, before any conversion."""
    if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
        got = sorted(osd) if isinstance(osd, Mapping) else type(osd).__name__
        raise ValueError(
            f"optim_state_dict must be a dict with 'state' and 'param_groups' (got {got}): pass what "
            "FSDP.optim_state_dict(model, optim) returned"
        )
    by_fqn = {f: (ref, k) for ref in params for k, f in enumerate(ref.fqns)}
    known = {f for ref in param_refs(model).values() for f in ref.fqns}
    for key in osd["state"]:
        if isinstance(key, int):
            raise ValueError(
                f"optimizer state key {key!r} is a parameter id: this is an optimizer's own state_dict(), "
                "not one keyed by parameter names; save with FSDP.optim_state_dict(model, optim) (or rekey "
                "it with FSDP.rekey_optim_state_dict(..., OptimStateKeyType.PARAM_NAME, model))"
            )
        if key not in known:
            raise ValueError(
                f"optimizer state for unknown parameter {key!r}: the model has no parameter of that name; "
                "load optimizer state saved from the same model (or drop that entry)"
            )
        if key not in by_fqn:
            raise ValueError(
                f"optimizer state for parameter {key!r}, which this optimizer does not hold: build the "
                "optimizer over the same parameters as the one that was saved"
            )
    saved_groups = osd["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(
            f"the saved optimizer state has {len(saved_groups)} param groups but the optimizer has "
            f"{len(optim.param_groups)}: build the optimizer with the same param groups"
        )
    refs = param_refs(model)
    for g, (saved, group) in enumerate(zip(saved_groups, optim.param_groups)):
        want = [f for p in group["params"] for f in refs[id(p)].fqns]
        if set(saved["params"]) != set(want):
            diff = sorted(set(saved["params"]) ^ set(want))
            raise ValueError(
                f"param group {g}: the saved group lists {len(saved['params'])} parameters, the optimizer's "
                f"{len(want)}; they differ in {diff[:5]}: build the optimizer with the same param groups"
            )
    for fqn, st in osd["state"].items():
        ref, k = by_fqn[fqn]
        shape = ref.state.unit.handle.layout.params[ref.indices[k]].shape if ref.state is not None else tuple(ref.param.shape)
        sharded_unit = ref.state is not None and ref.state.config.sharded
        for name, value in st.items():
            if not _is_sharded_tensor_state(value):
                continue
            if tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"optimizer state {name!r} of parameter {fqn!r} has shape {tuple(value.shape)} but the "
                    f"parameter has shape {tuple(shape)}: load optimizer state of the same model configuration"
                )
            if full and isinstance(value, DTensor):
                raise ValueError(
                    f"optimizer state {name!r} of {fqn!r} is a DTensor (SHARDED_STATE_DICT) but the active type "
                    "is FULL_STATE_DICT: load it inside FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)"
                )
            if not full and sharded_unit and not isinstance(value, DTensor):
                raise ValueError(
                    f"optimizer state {name!r} of {fqn!r} is a plain tensor (FULL_STATE_DICT) but the active type "
                    "is SHARDED_STATE_DICT: load it inside FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT)"
                )


def _flat_state(ref: ParamRef, saved: list[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """A flat parameter's state from the saved state of each of its original parameters."""
    present = [s for s in saved if s]
    if not present:
        return None
    if len(present) != len(saved):
        missing = [f for f, s in zip(ref.fqns, saved) if not s]
        raise ValueError(
            f"optimizer state is missing for {missing[:5]} but present for other parameters of the same "
            "unit: they are stepped together, so save and load them together"
        )
    handle = ref.state.unit.handle
    flat = handle.flat_param
    out: dict[str, Any] = {}
    for key, first in present[0].items():
        if not _is_sharded_tensor_state(first):
            out[key] = copy.deepcopy(first)
            continue
        new = torch.zeros(flat.numel(), dtype=first.dtype, device=flat.device)
        for i, st in zip(ref.indices, saved):
            write_param(handle, i, full_tensor(st[key]), new)
        out[key] = new
    return out


def _orig_state(ref: ParamRef, saved: Mapping[str, Any]) -> dict[str, Any] | None:
    handle = ref.state.unit.handle if ref.state is not None else None
    out: dict[str, Any] = {}
    held = True
    for key, value in saved.items():
        if not _is_sharded_tensor_state(value):
            out[key] = copy.deepcopy(value)
            continue
        full = full_tensor(value)
        if handle is None:
            out[key] = full.clone()
            continue
        piece = shard_piece(handle, ref.indices[0], full)
        held = held and piece is not None
        out[key] = piece
    # A parameter with nothing in this rank's shard has no state (it never gets a gradient here).
    return out if held else None


@torch.no_grad()
def flatten_for_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: Mapping[str, Any],
    full: bool,
    is_named_optimizer: bool = False,
) -> dict[str, Any]:
    """A per-FQN optimizer state dict as ``optim.load_state_dict`` takes it for this rank."""
    refs = param_refs(model)
    params = _optim_params(optim, refs)
    _check_osd(model, optim, osd, params, full)
    saved_state = osd["state"]
    state: dict[Any, Any] = {}
    for key, ref in enumerate(params):
        out_key = ref.raw_name if is_named_optimizer else key
        if ref.flat:
            st = _flat_state(ref, [saved_state.get(f) for f in ref.fqns])
        else:
            saved = saved_state.get(ref.fqns[0])
            st = _orig_state(ref, saved) if saved else None
        if st is not None:
            state[out_key] = st
    groups = []
    for saved, group in zip(osd["param_groups"], optim.param_groups):
        g = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
        start = sum(len(pg["params"]) for pg in optim.param_groups[: optim.param_groups.index(group)])
        ids = list(range(start, start + len(group["params"])))
        g["params"] = [params[i].raw_name for i in ids] if is_named_optimizer else ids
        groups.append(g)
    return {"state": state, "param_groups": groups}
