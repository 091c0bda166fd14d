"""Rank-side jobs of the harness suites (module-level, pickled by name by ``RankPool``)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from harness.cases.case import CaseConfig
from harness.compare.trace import CommTrace
from harness.ranks.rank import RankContext

#: a small healthy case: warms the fault pool, and after each fault proves the pool recovered.
HEALTHY = CaseConfig(engine="torch-fsdp", reference="ddp", model="nested", steps=2)

#: The fault pool's case timeout: short, so the hang and crash tests stay fast, long enough for a
#: tiny case on a loaded two-core machine.
FAULT_TIMEOUT_S = 5.0


def identity(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """Who this rank is, and the sum of all ranks over the process group."""
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world_size": ctx.world_size, "pid": os.getpid(), "sum": float(t), "payload": payload}


def environment(ctx: RankContext, key: str) -> str | None:
    """The rank's value of environment variable ``key``."""
    return os.environ.get(key)


def raise_everywhere(ctx: RankContext, payload: Any) -> None:
    raise ValueError(f"raised on purpose by rank {ctx.rank}")


def start_child(ctx: RankContext, payload: Any) -> int:
    """Start a child process that outlives the job (as an engine's forward starting a helper might), on
    the rank's stdout and stderr; its pid."""
    import subprocess

    return subprocess.Popen(["sleep", "600"]).pid


def sleep_forever(ctx: RankContext, payload: Any) -> None:
    """A hang in Python, without any collective."""
    while True:
        time.sleep(1)


def trace_collectives(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """Collectives of each kind under a ``CommTrace``, some paused, one after it ends."""
    ws = ctx.world_size
    original = dist.all_reduce
    with CommTrace() as trace:
        patched = dist.all_reduce is not original and dist.distributed_c10d.all_reduce is not original
        trace.phase, trace.step = "forward", 0
        dist.all_gather_into_tensor(torch.empty(2 * ws), torch.ones(2))
        trace.phase = "backward"
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * ws))
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        with trace.paused():
            dist.all_reduce(torch.ones(1))
        dist.all_gather([torch.empty(4) for _ in range(ws)], torch.ones(4))
        trace.phase, trace.step = "step", 1
        dist.broadcast(torch.ones(5, dtype=torch.bfloat16), src=0)
    dist.all_reduce(torch.ones(1))
    return {
        "events": [asdict(e) for e in trace.events],
        "patched_inside": patched,
        "restored": dist.all_reduce is original and dist.distributed_c10d.all_reduce is original,
    }


def reserve_and_drop(ctx: RankContext, nbytes: int) -> int:
    """Allocate ``nbytes`` on the rank's GPU, drop it inside a reference cycle (as an engine's state may sit),
    and return what the caching allocator holds reserved then."""
    holder: dict[str, Any] = {"tensor": torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)}
    holder["self"] = holder
    del holder
    return torch.cuda.memory_reserved(ctx.device)


def reserved_bytes(ctx: RankContext, payload: Any) -> int:
    return torch.cuda.memory_reserved(ctx.device)


def prefetch_baselines(ctx: RankContext, case: CaseConfig) -> dict[str, Any]:
    """``case``'s prefetch baseline through the cache, then its other reference's (read back) and a faulted
    twin's (run again): the runs each needed, and whether the traces agree."""
    from harness.compare.parity import _run_engine
    from harness.compare.prefetch_baseline import BASELINES, baseline_events
    from harness.engines.registry import resolve

    BASELINES.clear()  # an earlier case's own run may have kept this configuration's
    runs: list[str] = []

    def counted(adapter: Any, c: CaseConfig, rank_ctx: RankContext, steps: int) -> Any:
        runs.append(c.reference)
        return _run_engine(adapter, c, rank_ctx, steps)

    adapter = resolve(case.engine)
    first = baseline_events(counted, adapter, case, ctx, 2)
    other = baseline_events(counted, adapter, case.replace(reference="local" if case.reference == "ddp" else "ddp"), ctx, 2)
    fresh = _run_engine(adapter, case, ctx, 2).events
    faulted = baseline_events(counted, adapter, case.replace(extras=(("fault", "ignore_option:none"),)), ctx, 2)
    return {"runs": runs, "same": first == other == fresh, "faulted_ran": len(faulted) > 0}


def own_run_as_baseline(ctx: RankContext, case: CaseConfig) -> dict[str, Any]:
    """``case``'s own run kept as a baseline (``keep_own_run``), against a fresh baseline run of it: whether one
    was kept, whether the traces agree, and the fresh trace's length."""
    from harness.compare.parity import _run_engine
    from harness.compare.prefetch_baseline import BASELINES, baseline_key, baseline_steps, keep_own_run
    from harness.engines.registry import resolve

    BASELINES.clear()
    adapter = resolve(case.engine)
    keep_own_run(case, ctx, _run_engine(adapter, case, ctx, case.steps).events)
    steps = baseline_steps(case)
    kept = BASELINES.get(baseline_key(case, steps, ctx))
    fresh = _run_engine(adapter, case, ctx, steps).events
    return {"kept": kept is not None, "same": kept == fresh, "events": len(fresh)}


def clear_baselines(ctx: RankContext, payload: Any) -> int:
    from harness.compare.prefetch_baseline import BASELINES

    BASELINES.clear()
    return BASELINES.hits


def baseline_hits(ctx: RankContext, payload: Any) -> int:
    from harness.compare.prefetch_baseline import BASELINES

    return BASELINES.hits


def object_gathers_of_a_run(ctx: RankContext, case: CaseConfig) -> dict[str, Any]:
    """``case``'s engine run with ``dist.all_gather_object`` counted, and the gradient norms it observed."""
    import torch.distributed as dist

    from harness.compare.parity import _run_engine
    from harness.engines.registry import resolve

    gather, calls = dist.all_gather_object, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_object = counted
    try:
        obs = _run_engine(resolve(case.engine), case, ctx, case.steps)
    finally:
        dist.all_gather_object = gather
    return {"gathers": len(calls), "norms": obs.grad_norms}
