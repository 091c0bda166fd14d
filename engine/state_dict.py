"""Model state dicts of the engine: what ``state_dict()`` returns and ``load_state_dict()`` accepts.

Three types, as torch FSDP1 (selected with ``FSDP.state_dict_type``):

- ``FULL_STATE_DICT``: clean names (no ``_fsdp_wrapped_module.``/``_flat_param``), each original
  parameter unsharded in its original shape and full precision; ``rank0_only`` leaves the other
  ranks' dicts empty (they still take part in the gathers), ``offload_to_cpu`` copies to CPU.
- ``SHARDED_STATE_DICT``: clean names, each original parameter a ``DTensor`` over the unit's shard
  group (``Shard(0)``, ``torch.chunk`` chunks), so ``torch.distributed.checkpoint`` saves it and
  loads it at another world size. Buffers are plain tensors.
- ``LOCAL_STATE_DICT``: one entry per unit, ``<unit prefix>_flat_param``, this rank's flat shard
  without its right padding as a ``ShardedTensor`` (torch FSDP1's key and value type); with
  ``use_orig_params`` only that entry is kept (torch also leaves the 1-D views of the original
  parameters in, which are meaningless outside the engine). Loading accepts the ``ShardedTensor`` or
  a plain tensor holding the local shard (padded or not).

NO_SHARD units produce full state dicts for every type (torch FSDP1 does the same, with a warning).

Saving runs as a state-dict post-hook on every unit (innermost first), so a plain module holding
the root produces the same dict. Loading (:func:`load_model_state_dict`, the wrapper's
``load_state_dict``) validates the whole dict first -- keys, value types for the active type,
shapes -- and only then writes, so a bad checkpoint leaves the model exactly as it was.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from engine.api import StateDictType
from engine.dtensors import full_tensor
from engine.flat_param import FlatParameter, FlatParamHandle
from engine.flat_state import chunk_dtensor, full_tensors, mesh_for, write_param
from engine.module_tree import is_fsdp
from engine.state import ModuleState, fsdp_states
from engine.state_dict_config import FLAT_PARAM, FSDP_PREFIX, clean_fqn, effective_settings
from engine.unit import TrainingState, ViewState

__all__ = ["load_model_state_dict", "post_state_dict_hook"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _param_index_by_name(handle: FlatParamHandle) -> dict[str, int]:
    """Every registered name of the handle's parameters (tied ones too) -> index of the original."""
    index = {e.fqn: i for i, e in enumerate(handle.layout.params)}
    for info in handle.shared_param_infos:
        index[_join(info.module_name, info.param_name)] = index[_join(info.prim_module_name, info.prim_param_name)]
    return index


def _check_idle(state: ModuleState, what: str) -> None:
    unit = state.unit
    busy = unit is not None and unit.training_state != TrainingState.IDLE
    if busy or state.lifecycle.state != TrainingState.IDLE:
        raise RuntimeError(
            f"{what} cannot run during forward, backward or summon_full_params (unit wrapping "
            f"{type(state.module).__name__}): call it between iterations"
        )


def _adopt_user_edits(state: ModuleState) -> None:
    """With ``use_orig_params`` the shard is authoritative only after edits to the original
    parameters are written back (the runtime does this before each forward)."""
    unit = state.unit
    if unit is not None and unit.config.use_orig_params and unit.view_state == ViewState.SHARDED:
        unit.writeback()


def _own_buffer_names(state: ModuleState) -> set[str]:
    """Names (relative to the wrapped module) of the persistent buffers this unit manages."""
    names: set[str] = set()

    def walk(module: nn.Module, prefix: str) -> None:
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                names.add(_join(prefix, name))
        for child_name, child in module._modules.items():
            if child is not None and not is_fsdp(child):
                walk(child, _join(prefix, child_name))

    walk(state.module, "")
    return names


def _local_value(state: ModuleState) -> ShardedTensor:
    """This rank's flat shard without right padding, as torch FSDP1's ``ShardedTensor`` (a view)."""
    flat = state.unit.handle.flat_param
    valid = flat.numel() - flat._shard_numel_padded
    shards = []
    if valid > 0:
        # The placement names the global rank (torch FSDP1 passes the group rank, which is wrong
        # for any shard group other than the world, e.g. hybrid sharding).
        owner = dist.get_global_rank(state.config.shard_group, state.rank)
        shards = [Shard.from_tensor_and_offsets(flat.detach()[:valid].view(valid), [flat.numel() * state.rank], owner)]
    return init_from_local_shards(shards, state.unit.handle.layout.total_numel, process_group=state.config.shard_group)


@torch.no_grad()
def post_state_dict_hook(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Turn the ``nn.Module`` state dict of one unit's subtree into the active type (in place)."""
    state: ModuleState = wrapper._fsdp_state
    _check_idle(state, "state_dict()")
    sd_type, config = effective_settings(state, warn=True)
    inner = prefix + FSDP_PREFIX
    unit = state.unit
    own_params: dict[str, int] = {}
    values: list[Any] = []
    if unit is not None:
        _adopt_user_edits(state)
        handle = unit.handle
        own_params = {inner + name: i for name, i in _param_index_by_name(handle).items()}
        own_params[inner + FLAT_PARAM] = -1
        if sd_type == StateDictType.FULL_STATE_DICT:
            values = full_tensors(unit, handle.flat_param)
        elif sd_type == StateDictType.SHARDED_STATE_DICT:
            mesh = mesh_for(state)
            values = [chunk_dtensor(v, mesh) for v in full_tensors(unit, handle.flat_param)]
        if config.offload_to_cpu:
            values = [v.cpu() for v in values]
    rank0_skip = sd_type == StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False) and state.rank != 0
    own_buffers = {inner + name for name in _own_buffer_names(state)}
    entries = [(k, state_dict.pop(k)) for k in [k for k in state_dict if k.startswith(prefix)]]
    emitted_flat = False
    for key, value in entries:
        new_key = prefix + key[len(inner) :] if key.startswith(inner) else key
        if key in own_params:
            if rank0_skip:
                continue
            if sd_type == StateDictType.LOCAL_STATE_DICT:
                if not emitted_flat:
                    local = _local_value(state)
                    state_dict[prefix + FLAT_PARAM] = local.cpu() if config.offload_to_cpu else local
                    emitted_flat = True
                continue
            if own_params[key] >= 0:
                state_dict[new_key] = values[own_params[key]]
            else:
                # use_orig_params=False: the flat parameter stands for every original name.
                for name, i in _param_index_by_name(unit.handle).items():
                    state_dict[prefix + name] = values[i]
            continue
        if key in own_buffers:
            if rank0_skip:
                continue
            if config.offload_to_cpu:
                value = value.cpu()
        state_dict[new_key] = value


# ---------------------------------------------------------------------------------------- loading
class _Target(NamedTuple):
    """One key the active state-dict type expects, and where its value goes."""

    key: str
    #: "param" (an original parameter of ``state``), "flat" (a unit's local shard), "tensor"
    #: (a buffer or a parameter no unit manages).
    kind: str
    state: ModuleState | None
    #: index of the original parameter in its handle; -1 otherwise.
    index: int
    #: False for the second name of a tied parameter (loaded once, under its first name).
    primary: bool
    tensor: Tensor | None
    shape: tuple[int, ...]


def _targets(root: nn.Module) -> list[_Target]:
    managed: set[int] = set()
    targets: list[_Target] = []
    for name, module in root.named_modules():
        if not is_fsdp(module) or module._fsdp_state.unit is None:
            continue
        state = module._fsdp_state
        handle = state.unit.handle
        managed.add(id(handle.flat_param))
        managed.update(id(p) for p in (*handle.orig_params, *handle.shared_orig_params))
        prefix = clean_fqn(name)
        sd_type, _ = effective_settings(state)
        if sd_type == StateDictType.LOCAL_STATE_DICT:
            targets.append(_Target(_join(prefix, FLAT_PARAM), "flat", state, -1, True, None, (handle.layout.total_numel,)))
            continue
        seen: set[int] = set()
        for param_name, i in _param_index_by_name(handle).items():
            entry = handle.layout.params[i]
            key = clean_fqn(_join(prefix, param_name))
            targets.append(_Target(key, "param", state, i, i not in seen, None, entry.shape))
            seen.add(i)
    for name, module in root.named_modules():
        for pname, p in module._parameters.items():
            if isinstance(p, nn.Parameter) and id(p) not in managed and not isinstance(p, FlatParameter):
                targets.append(_Target(clean_fqn(_join(name, pname)), "tensor", None, -1, True, p, tuple(p.shape)))
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                targets.append(_Target(clean_fqn(_join(name, bname)), "tensor", None, -1, True, b, tuple(b.shape)))
    return targets


def _is_sharded_value(value: Any) -> bool:
    return isinstance(value, (DTensor, ShardedTensor))


def _check_formats(targets: list[_Target], state_dict: Mapping[str, Any], active: StateDictType) -> None:
    """Recognize a state dict of another type than the active one and say which it is."""
    flat_keys = [k for k in state_dict if k == FLAT_PARAM or k.endswith("." + FLAT_PARAM)]
    expects_flat = any(t.kind == "flat" for t in targets)
    if flat_keys and not expects_flat:
        raise ValueError(
            f"The state dict holds flat-parameter key {flat_keys[0]!r}, the format of LOCAL_STATE_DICT, "
            f"but the active type is {active.name}: load it inside "
            "FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)"
        )
    param_keys = [t.key for t in targets if t.kind == "param"]
    if expects_flat and not flat_keys:
        present = [k for k in param_keys if k in state_dict] or [
            k for k in state_dict if k not in {t.key for t in targets}
        ]
        if present:
            raise ValueError(
                f"The state dict holds per-parameter key {present[0]!r} but no '_flat_param' key, while "
                "the active type is LOCAL_STATE_DICT: load it inside FSDP.state_dict_type(model, "
                "StateDictType.FULL_STATE_DICT) or SHARDED_STATE_DICT, whichever it was saved with"
            )
    for t in targets:
        if t.kind != "param" or t.key not in state_dict:
            continue
        value = state_dict[t.key]
        sharded_unit = effective_settings(t.state)[0] == StateDictType.SHARDED_STATE_DICT
        if not sharded_unit and _is_sharded_value(value):
            raise ValueError(
                f"state_dict[{t.key!r}] is a {type(value).__name__}, the format of SHARDED_STATE_DICT, "
                f"but the active type is {active.name}: load it inside "
                "FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)"
            )
        if sharded_unit and not isinstance(value, DTensor):
            raise ValueError(
                f"state_dict[{t.key!r}] is a {type(value).__name__}, not a DTensor, but the active type is "
                "SHARDED_STATE_DICT: a full state dict loads inside "
                "FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT)"
            )


def _check_shapes(targets: list[_Target], state_dict: Mapping[str, Any]) -> None:
    for t in targets:
        if t.key not in state_dict:
            continue
        value = state_dict[t.key]
        if not isinstance(value, Tensor):
            raise TypeError(f"state_dict[{t.key!r}] is a {type(value).__name__}; expected a tensor")
        if t.kind == "flat":
            flat = t.state.unit.handle.flat_param
            valid = flat.numel() - flat._shard_numel_padded
            if isinstance(value, ShardedTensor):
                if tuple(value.size()) != t.shape:
                    raise ValueError(
                        f"size mismatch for {t.key}: the checkpoint's flat parameter has {tuple(value.size())[0]} "
                        f"elements but this unit's has {t.shape[0]}: load a LOCAL_STATE_DICT saved from the "
                        "same model, wrapping and world size"
                    )
                local = sum(s.tensor.numel() for s in value.local_shards())
            else:
                local = value.numel()
            if local not in (valid, flat.numel()):
                raise ValueError(
                    f"size mismatch for {t.key}: the checkpoint's local shard has {local} elements but this "
                    f"rank's shard has {valid} ({flat.numel()} padded): load a LOCAL_STATE_DICT saved at the "
                    "same world size"
                )
            continue
        if tuple(value.shape) != t.shape:
            raise ValueError(
                f"size mismatch for {t.key}: copying a param with shape {tuple(value.shape)} from the "
                f"checkpoint, the shape in the current model is {t.shape}: load a checkpoint of the same "
                "model configuration"
            )


def _local_shard(value: Tensor, flat: Tensor) -> Tensor:
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        value = shards[0].tensor if shards else flat.new_zeros(0)
    out = torch.zeros_like(flat)
    out[: value.numel()].copy_(value.reshape(-1))
    return out


def load_model_state_dict(root: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> _IncompatibleKeys:
    """Load ``state_dict`` (of the active type) into ``root``'s units, buffers and other parameters.

    Everything is checked before anything is written: a bad dict raises and changes nothing.
    """
    states = fsdp_states(root)
    for s in states:
        _check_idle(s, "load_state_dict()")
    for s in states:
        _adopt_user_edits(s)
    active = states[0].state_dict_settings.state_dict_type if states else StateDictType.FULL_STATE_DICT
    targets = _targets(root)
    _check_formats(targets, state_dict, active)
    expected = {t.key for t in targets}
    missing = [t.key for t in targets if t.key not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(root).__name__} ({active.name}): "
            f"missing keys {missing}, unexpected keys {unexpected}: load a state dict saved from this "
            "model with the same StateDictType, or pass strict=False to load only the matching keys"
        )
    _check_shapes(targets, state_dict)

    with torch.no_grad():
        # Converting may gather (DTensor values): every rank walks the targets in the same order.
        new_flats: dict[int, tuple[Any, Tensor]] = {}
        for t in targets:
            if t.key not in state_dict or not t.primary or t.kind == "tensor":
                continue
            flat = t.state.unit.handle.flat_param
            if t.kind == "flat":
                new_flats[id(t.state)] = (t.state, _local_shard(state_dict[t.key], flat.detach()))
                continue
            _, new = new_flats.setdefault(id(t.state), (t.state, flat.detach().clone()))
            write_param(t.state.unit.handle, t.index, full_tensor(state_dict[t.key]).to(new.dtype), new)
        tensors = [(t.tensor, full_tensor(state_dict[t.key])) for t in targets if t.kind == "tensor" and t.key in state_dict]

        for state, new in new_flats.values():
            unit = state.unit
            unit.handle.flat_param.data.copy_(new)
            if unit.view_state == ViewState.SHARDED:
                # An unsharded copy made before the load is stale (the next unshard re-gathers).
                unit.reshard_stale()
        for tensor, value in tensors:
            tensor.copy_(value)
    return _IncompatibleKeys(missing, unexpected)
