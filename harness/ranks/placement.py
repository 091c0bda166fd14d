"""Where ranks run: the one placement rule of the harness.

Every front end (``run``, ``nightly``, ``certify``, ``bench``, ``perf``, torchrun, the pytest plugin)
asks this module where a pool of ``world_size`` ranks runs (``place``: the backend, the device and the
GPU of each rank; NCCL with one GPU per rank where there are enough, gloo with ranks sharing the GPUs
where there are fewer GPUs than ranks, gloo on the CPU without GPUs), which GPUs it takes (a disjoint
block per pytest-xdist worker where there are enough, shared evenly where there are not), how many
pools run side by side (``plan_lanes``, ``pools_per_group``, ``cuda_rank_budget``), how a hybrid
strategy splits the world into shard groups, and what CPU ranks will take from the machine
(``cpu_footprint``). Pure functions over plain numbers; only ``default_backend``, ``n_gpus``,
``host_facts`` and ``available_memory`` look at the machine. Nothing else in the harness reads the GPU
count to choose a backend (``suites/harness/test_placement_rule.py`` checks that).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "Backend",
    "BackendChoice",
    "CPU_WORLD_SIZE",
    "Device",
    "DeviceChoice",
    "OPTION_HELP",
    "PlacementError",
    "RANK_RSS_CUDA_BYTES",
    "cuda_rank_budget",
    "place",
    "WORKER_GPU_MEMORY",
    "xdist_auto_workers",
    "xdist_overcommit",
    "Footprint",
    "HostFacts",
    "Lane",
    "RANK_RSS_BYTES",
    "assign_devices",
    "available_memory",
    "cpu_footprint",
    "cpu_pool_check",
    "default_backend",
    "default_shard_size",
    "hybrid_shard_size",
    "rank_device_index",
    "rank_visible_devices",
    "gpus_shared",
    "host_facts",
    "n_gpus",
    "plan_lanes",
    "pools_per_group",
    "xdist_worker",
]

Backend = Literal["gloo", "nccl"]
BackendChoice = Literal["auto", "gloo", "nccl"]
Device = Literal["cpu", "cuda"]
DeviceChoice = Literal["auto", "cpu", "cuda"]

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
    """The GPU of each rank of one pool of ``world_size`` ranks in pytest-xdist worker ``worker_index`` of
    ``n_workers`` (or pool ``worker_index`` of ``n_workers`` side by side).

    Each worker owns a block of ``n_devices // n_workers`` consecutive GPUs, and every pool it starts
    (whatever its world size) takes the first ``world_size`` of its block: where the block is big
    enough, concurrent pools never share a GPU. Where it is not (8 workers on 2 GPUs), the workers
    share the GPUs, worker ``i`` starting at GPU ``i * world_size`` modulo ``n_devices`` so each GPU
    carries as many pools as the others. With fewer GPUs than ranks, rank ``r`` takes GPU ``(first + r)
    mod n_devices``: several ranks of one pool share a GPU, which only gloo allows (``place``).
    """
    if world_size < 1:
        raise ValueError(f"assign_devices: world_size={world_size} must be at least 1")
    if not 0 <= worker_index < n_workers:
        raise ValueError(f"assign_devices: worker_index={worker_index} must be in [0, n_workers={n_workers})")
    if n_devices < 1:
        raise ValueError(f"assign_devices: n_devices={n_devices} must be at least 1 (no GPU: run on CPU)")
    block = n_devices // n_workers
    if world_size <= block:
        first = worker_index * block
        return tuple(range(first, first + world_size))
    first = worker_index * world_size
    return tuple((first + k) % n_devices for k in range(world_size))


def gpus_shared(world_size: int, n_devices: int, n_workers: int = 1) -> bool:
    """Whether ``assign_devices`` makes pools of different xdist workers share GPUs."""
    return world_size > n_devices // n_workers


class PlacementError(ValueError):
    """An asked placement that cannot run on this host; the message is one line naming the option."""


@dataclass(frozen=True)
class Lane:
    """Where one pool of a run runs: its world size, backend and the GPU of each rank (None on CPU).

    The device (``cpu``, ``cuda``) is not the backend: gloo runs on CPU tensors and on CUDA tensors,
    and several gloo ranks may share one GPU (``ranks_per_gpu`` > 1), which NCCL refuses.
    """

    world_size: int
    backend: str
    devices: tuple[int, ...] | None

    @property
    def device(self) -> Device:
        return "cpu" if self.devices is None else "cuda"

    @property
    def ranks_per_gpu(self) -> int | None:
        """Most ranks of this pool on one GPU; None on CPU."""
        if self.devices is None:
            return None
        return max(self.devices.count(d) for d in set(self.devices))

    def describe(self, gpus: Iterable[int] | None = None) -> str:
        """``gloo on CPU``, ``nccl on GPUs [0, 1] (one per rank)``, ``gloo on GPUs [0] (2 ranks per GPU)``;
        ``gpus`` names the GPUs of several such pools side by side (default: this pool's)."""
        if self.devices is None:
            return f"{self.backend} on CPU"
        per = "one per rank" if self.ranks_per_gpu == 1 else f"{self.ranks_per_gpu} ranks per GPU"
        return f"{self.backend} on GPUs {sorted(set(self.devices if gpus is None else gpus))} ({per})"


#: what ``--backend`` and ``--device`` mean to ``place``, in every front end's help.
OPTION_HELP = {
    "backend": "auto: NCCL with one GPU per rank where there are enough GPUs, gloo with ranks sharing the GPUs "
               "where there are fewer, gloo on CPU without GPUs; gloo: gloo on the GPUs (or the CPU); nccl: "
               "one GPU per rank or refused",
    "device": "auto: the GPUs where there are any, else the CPU; cpu: gloo ranks on the CPU of a GPU host "
              "(the CPU tier); cuda: GPUs or refused",
}


def place(
    world_size: int,
    n_gpus: int,
    backend: BackendChoice = "auto",
    device: DeviceChoice = "auto",
    worker: int = 0,
    n_workers: int = 1,
) -> Lane:
    """The placement rule: where a pool of ``world_size`` ranks runs on a host with ``n_gpus`` visible GPUs.

    - ``n_gpus >= world_size``: NCCL, one GPU per rank;
    - ``1 <= n_gpus < world_size``: gloo on the GPUs, rank ``r`` on GPU ``r mod n_gpus`` (NCCL refuses
      two ranks on one GPU; gloo moves CUDA tensors through pinned host memory);
    - no GPU: gloo on the CPU.

    ``backend`` and ``device`` narrow it: ``device='cpu'`` keeps gloo ranks on the CPU of a GPU host (the
    CPU tier), ``backend='gloo'`` runs gloo on the GPUs even where NCCL could, ``backend='nccl'`` or
    ``device='cuda'`` that cannot run here raise ``PlacementError``. ``worker`` of ``n_workers`` (xdist
    workers, or pools side by side) picks the GPUs as ``assign_devices`` does.
    """
    if world_size < 1:
        raise PlacementError(f"--world-size {world_size}: must be at least 1")
    if backend not in ("auto", "gloo", "nccl"):
        raise PlacementError(f"--backend {backend!r}: choose auto, gloo or nccl")
    if device not in ("auto", "cpu", "cuda"):
        raise PlacementError(f"--device {device!r}: choose auto, cpu or cuda")
    if device == "cpu":
        if backend == "nccl":
            raise PlacementError("--backend nccl runs on GPUs only; drop --device cpu or use --backend gloo")
        return Lane(world_size, "gloo", None)
    if n_gpus < 1:
        if device == "cuda" or backend == "nccl":
            option = "--device cuda" if device == "cuda" else "--backend nccl"
            raise PlacementError(f"{option} needs a CUDA GPU but none is visible; use --device cpu (gloo on the CPU)")
        return Lane(world_size, "gloo", None)
    if backend == "nccl" and n_gpus < world_size:
        raise PlacementError(
            f"--backend nccl needs one GPU per rank ({world_size} for world size {world_size}) but {n_gpus} visible; "
            "use --backend gloo (ranks share the GPUs) or fewer ranks"
        )
    chosen: Backend = "nccl" if backend != "gloo" and n_gpus >= world_size else "gloo"
    return Lane(world_size, chosen, assign_devices(world_size, n_gpus, worker, n_workers))


def default_backend(world_size: int) -> Backend:
    """The backend ``place`` chooses for ``world_size`` ranks on this host."""
    return place(world_size, n_gpus()).backend  # type: ignore[return-value]


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


def hybrid_group_ranks(rank: int, world_size: int, shard_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shard group, replicate group)`` global ranks of ``rank``: shard groups of ``shard_size``
    consecutive ranks (a node's), replicas the ranks at the same place in the other shard groups, as
    FSDP1's default groups and a ``(replicate, shard)`` device mesh lay them out."""
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(f"hybrid shard_size={shard_size} must divide world_size={world_size}")
    first = rank - rank % shard_size
    return tuple(range(first, first + shard_size)), tuple(range(rank % shard_size, world_size, shard_size))


def rank_visible_devices(devices: tuple[int, ...] | None, visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` a pool's ranks start with, given the pool's ``devices`` and the parent's
    ``visible`` (None: unset): ``""`` for a CPU pool; for one distinct GPU per rank, the pool's GPUs in rank
    order, named as the parent names them, so that rank ``r`` computes on ``cuda:r``, ``cuda:$LOCAL_RANK`` as
    under torchrun (DeepSpeed ZeRO-3 puts parameters on ``cuda:$LOCAL_RANK`` whatever device it was given);
    None (the parent's) where ranks share GPUs."""
    if devices is None:
        return ""
    if len(set(devices)) != len(devices):
        return None
    names = [v.strip() for v in visible.split(",")] if visible else None
    if names is not None and max(devices) >= len(names):
        raise ValueError(f"PoolConfig.devices={devices} names GPUs past CUDA_VISIBLE_DEVICES={visible!r}")
    return ",".join(names[d] if names is not None else str(d) for d in devices)


def rank_device_index(devices: tuple[int, ...], rank: int) -> int:
    """The CUDA index rank ``rank`` computes on, in the devices ``rank_visible_devices`` leaves it."""
    return rank if len(set(devices)) == len(devices) else devices[rank]


@dataclass(frozen=True)
class HostFacts:
    """What the number of pools side by side depends on."""

    #: logical CPU cores this process may use.
    cpu_cores: int
    #: memory of the smallest visible GPU in bytes (0 without GPUs).
    gpu_memory_bytes: int = 0
    #: host memory available now in bytes; None where unknown (no limit is taken from it then).
    host_memory_bytes: int | None = None


def host_facts() -> HostFacts:
    """This machine's ``HostFacts``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = min((torch.cuda.get_device_properties(i).total_memory for i in range(n_gpus())), default=0)
    return HostFacts(cpu_cores=cores, gpu_memory_bytes=memory, host_memory_bytes=available_memory())


#: GPU memory one rank of a pool may take: the CUDA context (~0.5 GiB), NCCL's buffers and the caching
#: allocator's blocks for the zoo's models, with room to spare. On one H100 (torch 2.11) the whole tree with
#: ``-n 8``, every rank on the one GPU, ran at this figure (43 GiB at peak); at half of it, more pools lived
#: at once and ranks failed to start.
RANK_GPU_MEMORY = 4 << 30
#: resident host memory of one CUDA rank process: torch with its CUDA libraries loaded and a context
#: (measured on torch 2.11, one H100: about 1.1 GiB), with room for gloo's pinned staging buffers.
RANK_RSS_CUDA_BYTES = 2 << 30
#: cores kept for the parent (the runner threads, the writer), a fuzz campaign running alongside the
#: cases (the nightly's) and the rest of the machine.
RESERVED_CORES = 3
#: most pools sharing one group of GPUs: without MPS the processes time-slice each GPU, and beyond this the
#: context switches cost more than the idle time they fill (the zoo's kernels leave GPUs idle ~90%); under
#: MPS (``harness.ranks.mps``) 16 pools a GPU of world size 4 filled 64 cores and ran slower than 8.
MAX_POOLS_PER_GROUP = 8


def pools_per_group(lane: Lane, n_groups: int, host: HostFacts) -> int:
    """How many pools like ``lane`` share each of ``n_groups`` groups of GPUs (or, on CPU, run at all).

    A case is mostly host work (Python, kernel launches, small collectives) that leaves a GPU idle,
    so pools side by side fill it: as many as the cores allow (one core per rank beyond
    ``RESERVED_CORES``), the GPU memory allows (``RANK_GPU_MEMORY`` per rank, times the ranks that share
    a GPU) and the host memory allows (``RANK_RSS_CUDA_BYTES`` per CUDA rank), at most
    ``MAX_POOLS_PER_GROUP``. On CPU the ranks compete for the same cores, so a pool needs two cores
    per rank to be worth starting. Never below 1. ``--pools-per-gpu`` overrides this.
    """
    world_size = lane.world_size
    if world_size < 1 or n_groups < 1:
        raise ValueError(f"pools_per_group: world_size={world_size} and n_groups={n_groups} must be at least 1")
    if lane.device == "cpu":
        return max(1, min(MAX_POOLS_PER_GROUP, host.cpu_cores // (2 * world_size)))
    spare = max(host.cpu_cores - RESERVED_CORES, 0)
    by_cores = spare // (world_size * n_groups)
    per_gpu = lane.ranks_per_gpu or 1
    by_gpu_memory = (host.gpu_memory_bytes // (RANK_GPU_MEMORY * per_gpu) if host.gpu_memory_bytes
                     else MAX_POOLS_PER_GROUP)
    by_host_memory = (host.host_memory_bytes // (RANK_RSS_CUDA_BYTES * world_size * n_groups)
                      if host.host_memory_bytes is not None else MAX_POOLS_PER_GROUP)
    return max(1, min(MAX_POOLS_PER_GROUP, by_cores, by_gpu_memory, by_host_memory))


def cuda_rank_budget(host: HostFacts, n_gpus: int, n_workers: int = 1) -> int | None:
    """How many CUDA rank processes one of ``n_workers`` pytest-xdist workers may keep alive at once.

    Workers keep a pool per world size for the whole session, so ``-n 8`` with world sizes 2, 4 and 8
    on one GPU would hold 112 CUDA processes; each takes ``RANK_GPU_MEMORY`` of a GPU and
    ``RANK_RSS_CUDA_BYTES`` of host memory at most, and the workers share both evenly. None without
    GPUs (CPU ranks are budgeted by ``cpu_footprint``). Never below 1: a worker must run something.
    """
    if n_gpus < 1:
        return None
    by_gpu = (n_gpus * host.gpu_memory_bytes) // RANK_GPU_MEMORY if host.gpu_memory_bytes else None
    by_host = host.host_memory_bytes // RANK_RSS_CUDA_BYTES if host.host_memory_bytes is not None else None
    limits = [x for x in (by_gpu, by_host) if x is not None]
    if not limits:
        return None
    return max(1, min(limits) // max(n_workers, 1))


#: GPU memory one pytest-xdist worker's CUDA ranks take on each GPU at their peak, all pools together (the
#: generated cases' pools, a module's own, the ``harness run`` a test starts): on 2 H200s, ``pytest suites
#: --matrix pairwise --world-size 2`` peaked at 57 GiB a GPU under ``-n 8`` (7 GiB a worker); 4 H200s at world
#: sizes 2 and 4 under ``-n 16``, 111 GiB a GPU (7 GiB); 32 workers on 2 H200s filled them and ranks failed
#: to start with "CUDA error: out of memory" (torch 2.11, 2026-11-28).
WORKER_GPU_MEMORY = 8 << 30


def xdist_auto_workers(host: HostFacts) -> int | None:
    """How many pytest-xdist workers ``-n auto`` starts on ``host``: one per core, as pytest-xdist's own
    default, but on a GPU host no more than the GPUs' memory holds at ``WORKER_GPU_MEMORY`` a worker (every
    worker may hold ranks on every GPU: a pool of world size ``n_gpus``). None without GPUs: pytest-xdist's
    default."""
    if not host.gpu_memory_bytes:
        return None
    return max(1, min(host.cpu_cores, host.gpu_memory_bytes // WORKER_GPU_MEMORY))


def xdist_overcommit(host: HostFacts, n_workers: int) -> str | None:
    """What to change where ``n_workers`` pytest-xdist workers are more than ``host``'s GPUs hold
    (``xdist_auto_workers``); None where they fit."""
    fits = xdist_auto_workers(host)
    if fits is None or n_workers <= fits:
        return None
    return (f"-n {n_workers}: each pytest-xdist worker's ranks take about {WORKER_GPU_MEMORY >> 30} GiB of every "
            f"GPU, and these GPUs ({host.gpu_memory_bytes / (1 << 30):.0f} GiB) hold {fits} workers; more run out "
            f"of GPU memory (ranks fail to start): pass -n {fits} or fewer, or -n auto")


def plan_lanes(
    world_sizes: Sequence[int] | None,
    backend: BackendChoice,
    n_gpus: int,
    matrix_world_sizes: Sequence[int],
    *,
    device: DeviceChoice = "auto",
    host: HostFacts | None = None,
    pools: int | None = None,
) -> tuple[dict[int, list[Lane]], dict[int, str]]:
    """The pools per world size, and the world sizes that cannot run here with the reason.

    Each world size is placed by ``place``. With one GPU per rank the GPUs split into
    ``n_gpus // world_size`` disjoint groups, each running ``pools`` pools side by side (None:
    ``pools_per_group`` of ``host``; no host: 1); where ranks share GPUs (gloo), all GPUs are one group
    and pool ``i`` starts at GPU ``i * world_size`` so the ranks spread evenly; on CPU ``pools`` pools.
    Without ``world_sizes`` (the nightly's default) the world sizes that get one GPU per rank run; where
    none does, ``CPU_WORLD_SIZE`` ranks run and the others are listed with the option that runs them.
    Lanes are listed group by group, so the first lanes of a world size use every GPU. A placement that
    cannot run (``--backend nccl`` on too few GPUs) raises ``PlacementError``.
    """
    if pools is not None and pools < 1:
        raise ValueError(f"plan_lanes: pools={pools} must be at least 1 (--pools-per-gpu)")
    chosen = list(world_sizes or matrix_world_sizes)
    skipped: dict[int, str] = {}
    if not world_sizes:
        own = [ws for ws in chosen if n_gpus >= ws and device != "cpu"]
        keep = own or ([CPU_WORLD_SIZE] if backend != "nccl" else chosen[:1])
        where = "on CPU" if n_gpus < 1 or device == "cpu" else f"with {n_gpus} GPU(s) for more ranks"
        skipped = {ws: f"{where} the nightly runs {keep} ranks; pass --world-size {ws} to run these"
                   for ws in chosen if ws not in keep}
        chosen = keep
    lanes: dict[int, list[Lane]] = {}
    for ws in chosen:
        lane = place(ws, n_gpus, backend, device)
        groups = n_gpus // ws if lane.ranks_per_gpu == 1 else 1
        per_group = pools if pools is not None else (pools_per_group(lane, groups, host) if host is not None else 1)
        if lane.devices is None:
            lanes[ws] = [lane] * per_group
        elif lane.ranks_per_gpu == 1:
            lanes[ws] = [Lane(ws, lane.backend, tuple(range(i * ws, (i + 1) * ws)))
                         for _ in range(per_group) for i in range(groups)]
        else:
            lanes[ws] = [Lane(ws, lane.backend, tuple((p * ws + r) % n_gpus for r in range(ws))) for p in range(per_group)]
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


def _largest_cpu_pools(lanes: Mapping[int, Sequence[Lane]], cores: int, available_bytes: int | None) -> tuple[str, Footprint] | None:
    """``--world-size N on CPU (...)`` and the footprint of the world size whose CPU pools take the most
    ranks (its pools run side by side, their ranks alive at once); None without CPU pools."""
    cpu = {ws: sum(1 for lane in group if lane.device == "cpu") for ws, group in lanes.items()}
    cpu = {ws: pools for ws, pools in cpu.items() if pools}
    if not cpu:
        return None
    ws = max(cpu, key=lambda w: w * cpu[w])
    side = f" ({cpu[ws]} pools side by side, --pools-per-gpu)" if cpu[ws] > 1 else ""
    return f"--world-size {ws} on CPU{side}", cpu_footprint([ws * cpu[ws]], cores, available_bytes)


def cpu_pool_check(lanes: Mapping[int, Sequence[Lane]], cores: int, available_bytes: int | None) -> tuple[str | None, str | None]:
    """``(refusal, warning)`` for the CPU pools of a run: refused when their ranks need more memory than is
    free (started anyway, the OOM killer ends them mid-case, or swapping stalls them until Ctrl-C), warned
    when they crowd the cores or the memory; each None where it does not apply."""
    found = _largest_cpu_pools(lanes, cores, available_bytes)
    if found is None:
        return None, None
    where, footprint = found
    if available_bytes is not None and footprint.bytes > available_bytes:
        return (f"{where} takes {footprint.describe()}: more memory than is free; lower --world-size "
                "(or --pools-per-gpu), or free memory"), None
    if footprint.oversubscribed:
        return None, f"{where} takes {footprint.describe()}; cases will be slow or run out of memory"
    return None, None


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
