"""Conversions between a unit's flat shard and its original parameters' full tensors.

Model and optimizer checkpoints both hold per-parameter tensors (full, or as ``DTensor`` chunks)
while the engine holds one flat shard per unit; everything shaped like the flat shard (the
parameter itself, its optimizer moments) goes through these functions. Gathers are collectives over
the unit's shard group: every rank must call them in the same order.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engine import collectives
from engine.dtensors import distribute
from engine.flat_param import FlatParamHandle
from engine.layout import ParamEntry
from engine.unit import FsdpUnit

__all__ = [
    "chunk_dtensor",
    "compose_shard",
    "full_tensors",
    "mesh_for",
    "shard_piece",
    "write_param",
]

_MESH_ATTR = "_state_dict_device_mesh"


def mesh_for(state: Any) -> DeviceMesh:
    """The 1-D mesh over ``state``'s shard group that sharded values live on (built once per unit)."""
    mesh = state.__dict__.get(_MESH_ATTR)
    if mesh is None:
        unit = state.unit
        device_type = unit.device.type if unit is not None else "cpu"
        mesh = DeviceMesh.from_group(state.config.shard_group, device_type)
        state.__dict__[_MESH_ATTR] = mesh
    return mesh


def gather_full_flat(unit: FsdpUnit, shard: Tensor) -> Tensor:
    """The padded unsharded flat tensor of a shard-shaped ``shard`` (NO_SHARD: ``shard`` itself)."""
    handle = unit.handle
    if not handle.uses_sharded_strategy:
        return shard.detach()
    out = torch.empty(handle.layout.padded_unsharded_numel, dtype=shard.dtype, device=unit.device)
    collectives.all_gather_flat(shard.detach(), lambda: out, unit.config.shard_group, None, unit.device, shard.dtype)
    return out


def full_tensors(unit: FsdpUnit, shard: Tensor) -> list[Tensor]:
    """Each original parameter's full tensor (own storage) of a shard-shaped ``shard``."""
    full = gather_full_flat(unit, shard)
    return [v.clone() for v in unit.handle.unflat_views(full)]


def chunk_dtensor(full: Tensor, mesh: DeviceMesh) -> DTensor:
    """``full`` as a ``DTensor`` sharded on dim 0 over ``mesh`` (``torch.chunk`` chunks, as DTensor's
    ``Shard(0)``); this rank keeps only its chunk."""
    if full.dim() > 0:
        return distribute(full, mesh, [Shard(0)])
    # A scalar cannot be split: the first rank holds it, the others an empty piece.
    local = full.clone() if mesh.get_local_rank() == 0 else full.new_empty((0,))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def _storage_order(value: Tensor, entry: ParamEntry) -> Tensor:
    """``value``'s elements in the order the flat buffer stores the parameter (its own strides)."""
    if entry.contiguous:
        return value.reshape(-1)
    laid = torch.empty_strided(entry.shape, entry.stride, dtype=value.dtype, device=value.device)
    laid.copy_(value)
    return laid.as_strided((entry.numel,), (1,))


def write_param(handle: FlatParamHandle, i: int, value: Tensor, out: Tensor) -> None:
    """Write original parameter ``i``'s full ``value`` into ``out``, a tensor shaped like the flat
    parameter (this rank's shard, or the whole buffer for NO_SHARD): only the part this rank holds."""
    entry = handle.layout.params[i]
    flat = _storage_order(value.to(device=out.device), entry)
    if handle.uses_sharded_strategy:
        info = handle.flat_param._shard_param_infos[i]
        if info.in_shard:
            piece = flat[info.intra_param_start_idx : info.intra_param_end_idx + 1]
            out[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].copy_(piece)
    else:
        start = handle.layout.param_offsets()[i]
        out[start : start + entry.numel].copy_(flat)


def shard_piece(handle: FlatParamHandle, i: int, value: Tensor) -> Tensor | None:
    """What this rank's original parameter ``i`` holds of the full ``value`` with ``use_orig_params``:
    a 1-D piece of its shard (None when nothing is in the shard), or ``value`` itself for NO_SHARD."""
    if not handle.uses_sharded_strategy:
        return value.clone()
    info = handle.flat_param._shard_param_infos[i]
    if not info.in_shard:
        return None
    flat = _storage_order(value, handle.layout.params[i])
    return flat[info.intra_param_start_idx : info.intra_param_end_idx + 1].clone()


def compose_shard(handle: FlatParamHandle, pieces: Sequence[Tensor | None], like: Tensor) -> Tensor:
    """A flat-parameter-shaped tensor (zeros where nothing is given) from per-parameter pieces as
    ``use_orig_params`` parameters hold them (see :func:`shard_piece`)."""
    out = torch.zeros(handle.flat_param.numel(), dtype=like.dtype, device=like.device)
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        if handle.uses_sharded_strategy:
            info = handle.flat_param._shard_param_infos[i]
            if info.in_shard:
                out[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].copy_(piece.reshape(-1))
        else:
            write_param(handle, i, piece, out)
    return out
