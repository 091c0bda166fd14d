"""DTensors to full tensors and back with plain ``torch.distributed`` collectives: the harness's own.

The reference side never runs the engine under test's code (a bug there must not hide in both sides at
once), so the harness keeps its own copy of what ``engine.dtensors`` does, with every rule it has;
``suites/engine/test_dtensors.py`` runs the same checks on both copies.

``DTensor.full_tensor()``, ``distribute_tensor`` and the state-dict helpers built on them go through
functional collectives, which crash (SIGSEGV) on gloo process groups holding CUDA tensors (torch
2.11; an upstream fix was reverted): exactly where ranks share a GPU. These functions do the same
with ``dist.all_gather`` over each mesh dimension's group, which every backend runs on every device.

Shard placements follow DTensor's: ``Shard(d)`` on a mesh dimension of size ``n`` splits dim ``d`` as
``torch.chunk`` does (ceil-sized chunks, trailing ranks short or empty), mesh dimensions in order. A
CPU tensor on a group whose backend refuses CPU tensors (NCCL) travels through the group's accelerator
(:func:`staged`, the engine's rule in ``engine.collectives``: [Note: CPU tensors on accelerator groups]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

# ``torch.distributed.tensor`` is imported where it is used: importing it costs most of a second (sympy,
# the op registrations), which every process importing the engine registry (each command line, each pytest)
# paid for nothing; the ranks' forkserver preloads it (``harness.ranks.forkserver.FORKSERVER_PRELOAD``).

__all__ = ["chunk_rows", "comm_device", "device_types_of", "distribute", "full_tensor", "local_chunk", "staged"]


def device_types_of(backend: str) -> frozenset[str]:
    """The device types whose tensors a backend's collectives take: ``nccl`` only ``cuda``, ``gloo``
    ``cpu`` and ``cuda``, a ``cpu:gloo,cuda:nccl`` group both; a backend torch does not know, any."""
    if ":" in backend:
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(","))
    known = dist.Backend.backend_capability.get(backend.lower())
    return frozenset(known) if known else frozenset({"cpu", "cuda"})


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a collective over ``group`` takes a tensor that lives on ``device`` (see [Note: CPU tensors
    on accelerator groups] in ``engine.collectives``): itself where the backend takes its device type, else
    the group's bound device, else this process's current accelerator of a type the backend takes."""
    backend = str(dist.get_backend(group))
    types = device_types_of(backend)
    if device.type in types:
        return device
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.type in types:
        return bound
    for kind in sorted(types - {"cpu"}):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return torch.device(kind, module.current_device())
    raise RuntimeError(
        f"process group backend {backend!r} takes {sorted(types)} tensors, not {device.type} ones, and this "
        f"process has no such device to stage them on: run the ranks on {sorted(types)} devices or use gloo"
    )


def staged(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``tensor`` on the device ``group``'s collectives take: itself when it is there already, else a
    copy ([Note: CPU tensors on accelerator groups]); the caller copies results back."""
    device = comm_device(group, tensor.device)
    return tensor if tensor.device == device else tensor.to(device)


def chunk_rows(size: int, n: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``n`` when ``torch.chunk`` splits ``size`` elements."""
    step = math.ceil(size / n) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


def _shard_dim(placement: Placement) -> int | None:
    from torch.distributed.tensor import Shard

    if placement.is_replicate():
        return None
    if isinstance(placement, Shard) and type(placement) is Shard:
        return placement.dim
    raise ValueError(f"placement {placement!r}: only Shard(d) and Replicate() are gathered with plain collectives")


def local_chunk(full: Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> Tensor:
    """This rank's piece of ``full`` under ``placements`` on ``mesh`` (a view; no collective)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("local_chunk: this rank is not part of the mesh")
    local = full
    for mesh_dim, placement in enumerate(placements):
        dim = _shard_dim(placement)
        if dim is not None:
            start, length = chunk_rows(local.shape[dim], mesh.size(mesh_dim), coordinate[mesh_dim])
            local = local.narrow(dim, start, length)
    return local


def distribute(full: Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``full`` (the same on every rank) as a ``DTensor`` under ``placements``; this rank keeps a copy of
    its piece only. No collective, unlike ``distribute_tensor``."""
    from torch.distributed.tensor import DTensor

    full = full.contiguous()
    local = local_chunk(full, mesh, placements).clone()
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=full.shape, stride=full.stride())


def full_tensor(value: Tensor) -> Tensor:
    """The full tensor of a ``DTensor`` (a collective over its mesh: every rank calls it, in the same
    order); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    mesh, placements = value.device_mesh, value.placements
    coordinate = mesh.get_coordinate()
    # Shapes before each mesh dimension's split, so each gather knows every rank's chunk.
    shapes = [list(value.shape)]
    for mesh_dim, placement in enumerate(placements):
        shape = list(shapes[-1])
        dim = _shard_dim(placement)
        if dim is not None:
            shape[dim] = chunk_rows(shape[dim], mesh.size(mesh_dim), coordinate[mesh_dim])[1]
        shapes.append(shape)
    local = value.to_local().contiguous()
    for mesh_dim in reversed(range(len(placements))):
        dim = _shard_dim(placements[mesh_dim])
        if dim is None:
            continue
        local = _gather_dim(local, dim, shapes[mesh_dim][dim], mesh.get_group(mesh_dim), mesh.size(mesh_dim))
    return local


def _gather_dim(local: Tensor, dim: int, size: int, group: dist.ProcessGroup, n: int) -> Tensor:
    """Every rank's ``torch.chunk`` piece of dim ``dim`` (``size`` long in all) concatenated in rank order."""
    step = max(math.ceil(size / n), 1)
    padded_shape = list(local.shape)
    padded_shape[dim] = step
    if math.prod(padded_shape) == 0:
        out_shape = list(local.shape)
        out_shape[dim] = size
        return local.new_empty(out_shape)
    # Equal sizes for all_gather, and never zero elements: gloo aborts on an empty CUDA all-gather.
    padded = local.new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    # A CPU DTensor (optimizer state loaded to the CPU) on an NCCL mesh travels through its accelerator.
    padded = staged(padded, group)
    pieces = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(pieces, padded, group=group)
    parts = [piece.narrow(dim, 0, chunk_rows(size, n, r)[1]) for r, piece in enumerate(pieces)]
    return torch.cat(parts, dim=dim).to(local.device)
