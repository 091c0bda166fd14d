"""GPU slots: how many NCCL ranks of all the pytest-xdist workers of one run compute on one GPU at once.

[Note: NCCL under time-slicing]
NCCL's kernels spin on the GPU until their peers' data arrives. Several processes on one GPU take turns
(time-slicing), so a rank whose peer on another GPU is not scheduled spins away its turn, and the wait
grows with every process on each GPU its collective spans. Pools of pytest-xdist workers are placed
independently: ``-n 16`` at world sizes 2 and 4 on 4 GPUs keeps 16 world-size-4 pools, 16 NCCL ranks on
each GPU; such cases took 60 to 140 s that take 4 s on 2 CPU cores, and tests ran into pytest-timeout.
The nightly caps the pools on a group of GPUs in one process (``MAX_POOLS_PER_GROUP``); across processes,
``RankPool.run`` holds one slot per NCCL rank on its GPU for the length of a job, at most
``MAX_NCCL_RANKS_PER_GPU`` slots a GPU, and a job waits for its slots before its timeout starts. Gloo ranks
sharing a GPU do not spin on it and take no slot. The processes a test starts (``harness run`` and the
like, whose pools run on the same GPUs) take slots from the same directory (``SLOTS_ENV``).

Slots are ``flock``-ed files in a directory of the run: the kernel releases a killed holder's lock, so
nothing stays taken when a worker dies. GPUs are taken in ascending order, which keeps holders of
several GPUs from waiting on each other in a circle.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.ranks.placement import MAX_POOLS_PER_GROUP

__all__ = ["GpuSlots", "MAX_NCCL_RANKS_PER_GPU", "SLOTS_ENV", "installed", "install", "run_slots_dir", "slot_needs"]

#: NCCL ranks of one run computing on one GPU at once: the density the nightly runs its pools at.
MAX_NCCL_RANKS_PER_GPU = MAX_POOLS_PER_GROUP
#: how often a waiting job looks for a free slot.
POLL_S = 0.05


def slot_needs(backend: str, devices: Sequence[int] | None, per_gpu: int) -> list[tuple[int, int]]:
    """``[(gpu, slots)]`` in ascending GPU order a job of a pool on ``devices`` holds: one per NCCL rank
    (at most ``per_gpu``, so one pool can always run); none for gloo or CPU pools."""
    if backend != "nccl" or not devices:
        return []
    return [(gpu, min(count, per_gpu)) for gpu, count in sorted(Counter(devices).items())]


def run_slots_dir(run_id: str) -> Path:
    """The slots directory every process of the run ``run_id`` shares."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)
    return Path(tempfile.gettempdir()) / f"harness-gpu-slots-{safe}"


@dataclass(frozen=True)
class GpuSlots:
    """``per_gpu`` slots for each GPU, shared by every process that uses ``directory``."""

    directory: Path
    per_gpu: int = MAX_NCCL_RANKS_PER_GPU

    def __post_init__(self) -> None:
        if self.per_gpu < 1:
            raise ValueError(f"GpuSlots.per_gpu={self.per_gpu} must be at least 1")

    @contextlib.contextmanager
    def hold(self, backend: str, devices: Sequence[int] | None) -> Iterator[float]:
        """Hold the slots a job of a pool on ``devices`` needs; yields the seconds waited for them.
        Re-entrant in a thread (a job run while this thread holds slots takes none)."""
        needs = slot_needs(backend, devices, self.per_gpu)
        if not needs or getattr(_held, "depth", 0):
            yield 0.0
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        fds: list[int] = []
        _held.depth = 1
        try:
            for gpu, count in needs:
                fds.extend(self._take(gpu, count))
            yield time.monotonic() - start
        finally:
            _held.depth = 0
            for fd in fds:
                os.close(fd)  # closing releases the flock

    def _take(self, gpu: int, count: int) -> list[int]:
        """``count`` slots of ``gpu``, waiting until they are free."""
        taken: list[int] = []
        try:
            while len(taken) < count:
                for slot in range(self.per_gpu):
                    if len(taken) == count:
                        break
                    fd = os.open(self.directory / f"gpu{gpu}.slot{slot}", os.O_RDWR | os.O_CREAT, 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        continue
                    taken.append(fd)
                if len(taken) < count:
                    time.sleep(POLL_S)
        except BaseException:
            for fd in taken:
                os.close(fd)
            raise
        return taken

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


#: the environment variable that hands a run's slots directory to the processes a test starts (a
#: ``harness run``, ``certify`` or ``pytest`` of its own, whose pools would otherwise crowd the GPUs unseen).
SLOTS_ENV = "HARNESS_GPU_SLOTS_DIR"

_held = threading.local()
_installed: GpuSlots | None = None


def install(slots: GpuSlots | None) -> None:
    """Make ``slots`` the ones every ``RankPool`` of this process and of the processes it starts holds
    (None: none)."""
    global _installed
    _installed = slots
    if slots is None:
        os.environ.pop(SLOTS_ENV, None)
    else:
        os.environ[SLOTS_ENV] = f"{slots.per_gpu}:{slots.directory}"


def installed() -> GpuSlots | None:
    """The slots ``RankPool.run`` holds in this process: those installed here, else those of the run that
    started this process (``SLOTS_ENV``: ``PER_GPU:DIRECTORY``); None outside a pytest-xdist run."""
    global _installed
    given = os.environ.get(SLOTS_ENV)
    if _installed is None and given:
        per_gpu, _, directory = given.partition(":")
        if not per_gpu.isdigit() or not directory:
            raise ValueError(f"{SLOTS_ENV}={given!r}: expected PER_GPU:DIRECTORY, as harness.ranks.gpu_slots.install sets it")
        _installed = GpuSlots(Path(directory), int(per_gpu))
    return _installed
