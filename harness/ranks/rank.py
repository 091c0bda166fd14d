"""What a job sees on its rank: ``RankContext`` (identity, device, and process groups cached for the
pool's life). Jobs run by ``harness.ranks.pool.RankPool`` (or under torchrun) take it as first argument."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks.placement import hybrid_group_ranks

__all__ = ["RankContext", "new_hybrid_groups", "new_singleton_groups", "rank_device"]


def rank_device() -> torch.device:
    """This rank process's device: its current CUDA device where its pool gave it a GPU (one of its own or
    one shared with other ranks), else the CPU. Pools hide the GPUs from CPU ranks, so whether CUDA is
    available here says where the rank runs; the backend does not (gloo runs on both)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def new_hybrid_groups(rank: int, world_size: int, shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create the hybrid groups of ``shard_size`` consecutive ranks and their replicas, and return
    ``(shard group, replicate group)`` of ``rank``. Collective: every rank creates every group, in order."""
    shard_groups = [dist.new_group(list(hybrid_group_ranks(r, world_size, shard_size)[0]))
                    for r in range(0, world_size, shard_size)]
    replicate_groups = [dist.new_group(list(hybrid_group_ranks(r, world_size, shard_size)[1])) for r in range(shard_size)]
    return shard_groups[rank // shard_size], replicate_groups[rank % shard_size]


def new_singleton_groups(rank: int, world_size: int) -> dist.ProcessGroup:
    """Create a one-rank group per rank and return ``rank``'s. Collective: every rank creates every group, in order."""
    return [dist.new_group([r]) for r in range(world_size)][rank]


@dataclass
class RankContext:
    """What a job sees on its rank: identity, device, and process groups cached for the pool's life.

    Groups are created collectively (every rank, same order), so jobs ask for them through this
    object rather than calling ``new_group`` per case, which would leak a communicator per case.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def device_type(self) -> str:
        return self.device.type

    def world_group(self) -> dist.ProcessGroup:
        """All ranks of this context: the default group, or the group of a ``prefix`` context."""
        group = self._cache.get("prefix_group")
        return group if group is not None else dist.distributed_c10d._get_default_group()

    def prefix(self, n: int) -> "RankContext | None":
        """A context over ranks ``0..n-1`` alone (a checkpoint saved on some ranks, resumed on others);
        None on the ranks outside it. Collective: every rank calls it with the same ``n``.

        Only the world group and one-dimensional meshes are remapped; hybrid groups are not (a case
        that resumes at another world size runs no hybrid strategy).
        """
        if not 1 <= n <= self.world_size:
            raise ValueError(f"RankContext.prefix: n={n} must be in [1, world_size={self.world_size}]")
        key = ("prefix", n)
        if key not in self._cache:
            self.singleton_group()  # created collectively now, shared with the prefix context
            self._cache[key] = self.world_group() if n == self.world_size else dist.new_group(list(range(n)))
        if self.rank >= n:
            return None
        if n == self.world_size:
            return self
        sub = RankContext(self.rank, n, self.local_rank, min(self.local_world_size, n), self.backend, self.device)
        sub._cache["prefix_group"] = self._cache[key]
        sub._cache["singletons"] = self._cache["singletons"]
        return sub

    def singleton_group(self) -> dist.ProcessGroup:
        """A group of this rank alone (every rank creates every rank's, in order)."""
        if "singletons" not in self._cache:
            self._cache["singletons"] = new_singleton_groups(self.rank, self.world_size)
        return self._cache["singletons"]

    def hybrid_groups(self, shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """``(shard group, replicate group)`` of this rank for a shard-group size, as FSDP1 takes them."""
        if self.world_size % shard_size:
            raise ValueError(f"hybrid shard_size={shard_size} does not divide world_size={self.world_size}")
        key = ("hybrid", shard_size)
        if key not in self._cache:
            self._cache[key] = new_hybrid_groups(self.rank, self.world_size, shard_size)
        return self._cache[key]

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
        """A device mesh over all ranks (``init_device_mesh``), cached by shape."""
        key = ("mesh", shape, names)
        if key not in self._cache:
            from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

            if "prefix_group" in self._cache:
                if len(shape) != 1:
                    raise ValueError(f"RankContext.mesh: a prefix context has one-dimensional meshes only, not {shape}")
                self._cache[key] = DeviceMesh.from_group(self._cache["prefix_group"], self.device_type, mesh_dim_names=names)
            else:
                self._cache[key] = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        return self._cache[key]

    def singleton_mesh(self) -> Any:
        """A one-rank device mesh over ``singleton_group()``."""
        if "singleton_mesh" not in self._cache:
            from torch.distributed.device_mesh import DeviceMesh

            self._cache["singleton_mesh"] = DeviceMesh.from_group(self.singleton_group(), self.device_type)
        return self._cache["singleton_mesh"]

    def sequence_numbers(self) -> dict[str, int]:
        """Collective sequence number of every multi-rank group this rank holds.

        Keyed by what the group is and which global ranks it holds, so every member of a group
        reports it under the same key.
        """
        groups: list[tuple[str, dist.ProcessGroup]] = [("world", self.world_group())]
        for key, value in self._cache.items():
            if isinstance(key, tuple) and key[0] == "hybrid":
                groups += [(f"hybrid{key[1]}-shard", value[0]), (f"hybrid{key[1]}-replicate", value[1])]
            elif isinstance(key, tuple) and key[0] == "mesh":
                groups += [(f"mesh{key[1]}-{name}", value.get_group(dim)) for dim, name in enumerate(key[2])]
        numbers: dict[str, int] = {}
        for label, group in groups:
            ranks = dist.get_process_group_ranks(group)
            if len(ranks) > 1:
                numbers[f"{label}{ranks}"] = group._get_sequence_number_for_group()
        return numbers
