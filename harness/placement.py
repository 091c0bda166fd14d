"""Where ranks run: the one placement rule of the harness.

Every front end (``run``, ``nightly``, ``bench``, ``perf``, the pytest plugin) asks this module which
backend a pool of ``world_size`` ranks uses, which GPUs it takes (a disjoint block per pytest-xdist
worker where there are enough GPUs, shared evenly where there are not), how many pools run side by
side (``plan_lanes``, ``pools_per_group``), how a hybrid strategy splits the world into shard groups,
and what CPU ranks will take from the machine (``cpu_footprint``, warned about before a run that
crowds it). Pure functions over plain numbers; only ``default_backend``, ``n_gpus``, ``host_facts``
and ``available_memory`` look at the machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "Backend",
    "BackendChoice",
    "CPU_WORLD_SIZE",
    "Footprint",
    "HostFacts",
    "Lane",
    "RANK_RSS_BYTES",
    "assign_devices",
    "available_memory",
    "cpu_footprint",
    "default_backend",
    "default_shard_size",
    "hybrid_shard_size",
    "gpus_shared",
    "host_facts",
    "n_gpus",
    "plan_lanes",
    "pools_per_group",
    "xdist_worker",
]

Backend = Literal["gloo", "nccl"]
BackendChoice = Literal["auto", "gloo", "nccl"]

#: ranks per case on a machine without GPUs when no world size is asked for.
CPU_WORLD_SIZE = 2


def n_gpus() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def xdist_worker(env: dict[str, str] | None = None) -> tuple[int, int]:
    """``(index, count)`` of this pytest-xdist worker; ``(0, 1)`` outside xdist."""
    env = dict(os.environ) if env is None else env
    worker = env.get("PYTEST_XDIST_WORKER", "")
    if not worker:
        return 0, 1
    index = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0
    return index, max(int(env.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)


def assign_devices(world_size: int, n_devices: int, worker_index: int = 0, n_workers: int = 1) -> tuple[int, ...]:
    """The GPUs one pool of ``world_size`` ranks takes in pytest-xdist worker ``worker_index`` of ``n_workers``.

    Each worker owns a block of ``n_devices // n_workers`` consecutive GPUs, and every pool it starts
    (whatever its world size) takes the first ``world_size`` of its block: where the block is big
    enough, concurrent pools never share a GPU. Where it is not (8 workers on 2 GPUs), the workers
    share the GPUs, worker ``i`` starting at GPU ``i * world_size`` modulo ``n_devices`` so each GPU
    carries as many pools as the others. Sharing is sound (each pool has its own communicators and
    GPUs time-slice between processes) but makes timings noisy: ``gpus_shared`` says when it happens.
    """
    if world_size < 1:
        raise ValueError(f"assign_devices: world_size={world_size} must be at least 1")
    if not 0 <= worker_index < n_workers:
        raise ValueError(f"assign_devices: worker_index={worker_index} must be in [0, n_workers={n_workers})")
    if world_size > n_devices:
        raise ValueError(
            f"assign_devices: world_size={world_size} needs one GPU per rank but only {n_devices} are visible; "
            "run fewer ranks or on CPU (gloo)"
        )
    block = n_devices // n_workers
    if world_size <= block:
        first = worker_index * block
        return tuple(range(first, first + world_size))
    first = worker_index * world_size
    return tuple((first + k) % n_devices for k in range(world_size))


def gpus_shared(world_size: int, n_devices: int, n_workers: int = 1) -> bool:
    """Whether ``assign_devices`` makes pools of different xdist workers share GPUs."""
    return world_size > n_devices // n_workers


def default_backend(world_size: int) -> Backend:
    """``nccl`` when there is a GPU for every rank, else ``gloo`` on CPU (pytest-xdist workers share
    GPUs where there are too few for each to own some: ``assign_devices``)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def default_shard_size(world_size: int, local_world_size: int | None = None) -> int:
    """Shard-group size of the hybrid strategies: a node when there are several, else half the world.

    On one host FSDP1's default (shard within the node) would make hybrid sharding the same as full
    sharding, so a single host splits the world in two replicas instead.
    """
    if local_world_size and local_world_size < world_size and world_size % local_world_size == 0:
        return local_world_size
    if world_size >= 4 and world_size % 2 == 0:
        return world_size // 2
    return world_size


def hybrid_shard_size(extras: dict[str, Any], world_size: int, local_world_size: int | None = None) -> int:
    """A hybrid case's shard-group size: its ``shard_size`` extra, else ``default_shard_size``."""
    return int(extras.get("shard_size", default_shard_size(world_size, local_world_size)))


@dataclass(frozen=True)
class Lane:
    """One pool of a run: its world size, backend and GPUs (None on CPU)."""

    world_size: int
    backend: str
    devices: tuple[int, ...] | None


@dataclass(frozen=True)
class HostFacts:
    """What the number of pools side by side depends on."""

    #: logical CPU cores this process may use.
    cpu_cores: int
    #: memory of the smallest visible GPU in bytes (0 without GPUs).
    gpu_memory_bytes: int = 0


def host_facts() -> HostFacts:
    """This machine's ``HostFacts``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = min((torch.cuda.get_device_properties(i).total_memory for i in range(n_gpus())), default=0)
    return HostFacts(cpu_cores=cores, gpu_memory_bytes=memory)


#: GPU memory one rank of a pool may take: the CUDA context (~0.5 GiB), NCCL's buffers and the caching
#: allocator's blocks for the zoo's models (well under 1 GiB at peak), with room to spare.
RANK_GPU_MEMORY = 4 << 30
#: cores kept for the parent (the runner threads, the writer), a fuzz campaign running alongside the
#: cases (the nightly's) and the rest of the machine.
RESERVED_CORES = 3
#: most pools sharing one group of GPUs: the processes time-slice each GPU, and beyond this the
#: context switches cost more than the idle time they fill (the zoo's kernels leave GPUs idle ~90%).
MAX_POOLS_PER_GROUP = 8


def pools_per_group(world_size: int, backend: Backend, n_groups: int, host: HostFacts) -> int:
    """How many pools of ``world_size`` ranks share each group of GPUs (or, on CPU, run at all).

    A case is mostly host work (Python, kernel launches, small collectives) that leaves a GPU idle,
    so pools side by side fill it: as many as the cores allow (one core per rank beyond
    ``RESERVED_CORES``) and the GPU memory allows (``RANK_GPU_MEMORY`` per rank), at most
    ``MAX_POOLS_PER_GROUP``. On CPU the ranks compete for the same cores, so a pool needs two cores
    per rank to be worth starting. Never below 1. ``--pools-per-gpu`` overrides this.
    """
    if world_size < 1 or n_groups < 1:
        raise ValueError(f"pools_per_group: world_size={world_size} and n_groups={n_groups} must be at least 1")
    spare = max(host.cpu_cores - RESERVED_CORES, 0)
    if backend == "gloo":
        return max(1, min(MAX_POOLS_PER_GROUP, host.cpu_cores // (2 * world_size)))
    by_cores = spare // (world_size * n_groups)
    by_memory = host.gpu_memory_bytes // RANK_GPU_MEMORY if host.gpu_memory_bytes else MAX_POOLS_PER_GROUP
    return max(1, min(MAX_POOLS_PER_GROUP, by_cores, by_memory))


def plan_lanes(
    world_sizes: Sequence[int] | None,
    backend: BackendChoice,
    n_gpus: int,
    matrix_world_sizes: Sequence[int],
    *,
    host: HostFacts | None = None,
    pools: int | None = None,
) -> tuple[dict[int, list[Lane]], dict[int, str]]:
    """The pools per world size, and the world sizes that cannot run here with the reason.

    With GPUs every world size splits them into ``n_gpus // world_size`` disjoint groups and runs
    ``pools`` pools on each group side by side (None: ``pools_per_group`` of ``host``; no host: 1);
    on CPU (or with ``backend='gloo'``) ``pools`` pools per world size, 2 ranks unless asked otherwise.
    Lanes are listed group by group, so the first lanes of a world size use every GPU.
    """
    if pools is not None and pools < 1:
        raise ValueError(f"plan_lanes: pools={pools} must be at least 1 (--pools-per-gpu)")

    def count(ws: int, lane_backend: Backend, groups: int) -> int:
        if pools is not None:
            return pools
        return pools_per_group(ws, lane_backend, groups, host) if host is not None else 1

    use_nccl = backend == "nccl" or (backend == "auto" and n_gpus >= min(world_sizes or matrix_world_sizes))
    if not use_nccl:
        if world_sizes:
            return {ws: [Lane(ws, "gloo", None)] * count(ws, "gloo", 1) for ws in world_sizes}, {}
        others = {ws: f"on CPU the nightly runs {CPU_WORLD_SIZE} gloo ranks; pass --world-size {ws} to run these"
                  for ws in matrix_world_sizes if ws != CPU_WORLD_SIZE}
        return {CPU_WORLD_SIZE: [Lane(CPU_WORLD_SIZE, "gloo", None)] * count(CPU_WORLD_SIZE, "gloo", 1)}, others
    lanes: dict[int, list[Lane]] = {}
    skipped: dict[int, str] = {}
    for ws in world_sizes or matrix_world_sizes:
        groups = n_gpus // ws
        if groups < 1:
            skipped[ws] = f"world size {ws} needs {ws} GPUs (one per rank); {n_gpus} visible"
            continue
        per_group = count(ws, "nccl", groups)
        lanes[ws] = [Lane(ws, "nccl", tuple(range(i * ws, (i + 1) * ws))) for _ in range(per_group) for i in range(groups)]
    return lanes, skipped


#: resident memory of one CPU rank process with torch imported and a small case running (measured
#: on torch 2.13 CPU: 350 to 450 MB); the estimate's unit.
RANK_RSS_BYTES = 400 * 2**20


@dataclass(frozen=True)
class Footprint:
    """What the CPU ranks of a run take from the machine, estimated before starting them."""

    #: rank processes alive at once (the largest pool; pools of a run start one after the other).
    ranks: int
    #: the machine's cores.
    cores: int
    #: resident memory the ranks will take, about.
    bytes: int
    #: memory available now, if known.
    available_bytes: int | None

    @property
    def oversubscribed(self) -> bool:
        """More ranks than cores (collectives then wait on descheduled peers), or more memory than is free."""
        return self.ranks > self.cores or (self.available_bytes is not None and self.bytes > self.available_bytes)

    def describe(self) -> str:
        gib = 2**30
        free = f" of {self.available_bytes / gib:.1f} GiB available" if self.available_bytes is not None else ""
        return (f"{self.ranks} rank processes on {self.cores} CPU core(s) ({self.ranks / max(self.cores, 1):.0f} per core) "
                f"and about {self.bytes / gib:.1f} GiB of memory (~{RANK_RSS_BYTES // 2**20} MiB per rank){free}")


def cpu_footprint(world_sizes: Sequence[int], cores: int, available_bytes: int | None) -> Footprint:
    """The estimate for pools of ``world_sizes`` CPU ranks run one after the other (pure)."""
    ranks = max(world_sizes, default=0)
    return Footprint(ranks, cores, ranks * RANK_RSS_BYTES, available_bytes)


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
