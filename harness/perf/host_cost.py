"""The host-cost mode of ``python -m harness perf`` (``--host-cost``): the engines' host time per step, in
this process, over torch's fake process group.

On gloo ranks sharing a host's cores a step's time mixes the engine's Python with gloo's latency and the
ranks waiting on each other; on GPUs the host's work hides behind the kernels until the units are many
and small. Here one process is rank 0 of a fake group (``init_process_group("fake")``: every collective
returns at once without touching its tensors, everything else runs), the model has tiny tensors and many
units (``HOST_COST_MODEL``), and ``perf_job`` times each step in process time with the garbage collector
off (``PerfJob.host_cost``): what is left is the host's work per step, the engine's hooks, views and casts
first. No rank pool, no GPU.

``FakeWorld`` stands in for ``harness.ranks.pool.RankPool`` in ``harness.perf.perf_run.run_repetitions``
(the same jobs, the same ``PoolOutcome``), so the rows, their medians over repetitions and the paired
ratios are the normal mode's. It restores what it changes in this process when it exits (the default
process group, the intra-op threads, the random state), since tests call the command in-process.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.cases.models import GPTConfig
from harness.ranks.pool import PoolOutcome, PoolStartError
from harness.ranks.rank import RankContext

#: the earlier measurement's model (issue 39): width 8 and 4 tokens make every kernel next to free, and 32
#: blocks make 33 units (the root included), so a step is mostly the engines' per-unit Python.
HOST_COST_MODEL = GPTConfig(vocab=64, d_model=8, layers=32, heads=2, seq=4, batch=1)

#: the backend name torch's fake process group registers.
FAKE_BACKEND = "fake"


class FakeWorld:
    """Rank 0 of a fake process group of ``world_size`` in this process, for the length of a ``with``:
    ``run(fn, job)`` calls ``fn(ctx, job)`` here and answers as a pool does. Refuses to start over a
    process group that is already there (it would replace or tear down someone else's)."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"FakeWorld: world_size={world_size} must be >= 1")
        self.world_size = world_size
        # The shard sizes follow the world size; every collective, whatever its group, is a no-op.
        self.ctx = RankContext(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size,
                               backend=FAKE_BACKEND, device=torch.device("cpu"))
        self._restore = contextlib.ExitStack()

    def __enter__(self) -> FakeWorld:
        if dist.is_initialized():
            raise PoolStartError("--host-cost: this process already has a default process group; "
                                 "run the host-cost mode in a process of its own")
        # Importing it registers the "fake" backend with torch.distributed.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        with contextlib.ExitStack() as stack:
            # The jobs seed torch's generator: the caller's random state comes back as it was.
            stack.enter_context(torch.random.fork_rng(devices=[]))
            # Process time counts every thread's CPU seconds: an intra-op pool spinning over tiny tensors would
            # add time that is neither engine's work and varies with how each splits its ops (one thread, as
            # the earlier measurement ran).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
            dist.init_process_group(FAKE_BACKEND, rank=0, world_size=self.world_size, store=FakeStore())
            stack.callback(_destroy_default_group)
            self._restore = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore.close()

    def run(self, fn: Callable[[RankContext, Any], Any], job: Any) -> PoolOutcome:
        """``fn(ctx, job)`` on this process: ``ok`` with its answer, or ``error`` naming what it raised (an
        engine that fails is that run's row, as on the pool, not the end of the benchmark)."""
        if not dist.is_initialized():
            raise RuntimeError("FakeWorld.run outside its with-block: no fake process group")
        start = time.monotonic()
        try:
            value = fn(self.ctx, job)
        except Exception as exc:  # noqa: BLE001  # any engine error becomes the row's reason
            last = traceback.extract_tb(exc.__traceback__)[-1]
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} ({last.filename}:{last.lineno})"
            return PoolOutcome("error", [None], reason=reason, wall_s=time.monotonic() - start)
        return PoolOutcome("ok", [value], wall_s=time.monotonic() - start)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
