"""The process groups of one instance: torch FSDP1's ``process_group``/``device_mesh`` arguments as a
shard group and, for the hybrid strategies, a replicate group."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from engine.api import HYBRID_STRATEGIES, ShardingStrategy
from engine.config import hybrid_node_size

__all__ = ["ProcessGroupArg", "default_hybrid_groups", "resolve_groups"]

ProcessGroupArg = dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None


def resolve_groups(
    strategy: ShardingStrategy, process_group: ProcessGroupArg, device_mesh: Any
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """``(shard group, replicate group or None)`` from FSDP1's ``process_group``/``device_mesh``."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh to FullyShardedDataParallel: pass "
            "only one (a device_mesh for a 2-D hybrid layout, or the groups directly)"
        )
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        if hybrid:
            if device_mesh.ndim != 2:
                raise ValueError(
                    f"{strategy} needs a 2-D device_mesh (replicate, shard) but got {device_mesh.ndim} dimensions"
                )
            return device_mesh.get_group(mesh_dim=1), device_mesh.get_group(mesh_dim=0)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{strategy} needs a 1-D device_mesh but got {device_mesh.ndim} dimensions: use a "
                "hybrid strategy for a 2-D mesh"
            )
        return device_mesh.get_group(mesh_dim=0), None
    if hybrid:
        if isinstance(process_group, tuple):
            if len(process_group) != 2:
                raise ValueError(
                    f"{strategy} takes process_group=(shard_group, replicate_group); got {len(process_group)} groups"
                )
            return process_group[0], process_group[1]
        if process_group is not None:
            raise ValueError(
                f"{strategy} needs process_group=(shard_group, replicate_group) or a 2-D device_mesh; "
                "got a single process group"
            )
        return default_hybrid_groups()
    if isinstance(process_group, tuple):
        raise ValueError(
            f"process_group=(shard_group, replicate_group) is only valid with a hybrid strategy, not {strategy}"
        )
    return (process_group if process_group is not None else dist.distributed_c10d._get_default_group()), None


def default_hybrid_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """FSDP1's default: shard within a node, replicate across nodes (every rank builds every group).

    The node size is :func:`engine.config.hybrid_node_size`'s: the launcher's ``LOCAL_WORLD_SIZE``
    where set, else the CUDA device count.
    """
    world = dist.get_world_size()
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_node = hybrid_node_size(world, os.environ.get("LOCAL_WORLD_SIZE"), devices)
    rank = dist.get_rank()
    shard = replicate = None
    for start in range(0, world, per_node):
        group = dist.new_group(list(range(start, start + per_node)))
        if start <= rank < start + per_node:
            shard = group
    for offset in range(per_node):
        group = dist.new_group(list(range(offset, world, per_node)))
        if rank % per_node == offset:
            replicate = group
    return shard, replicate
