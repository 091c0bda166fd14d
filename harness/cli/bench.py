"""The pool's overhead benchmark: per-case cost of the warm pool against spawning the ranks per case.

Both sides run the same trivial case (one all-reduce of one element on every rank, so the process
group is really used) in one invocation:

- *warm*: one pool, started once (not timed), then ``--warm-cases`` cases; the mean per case is the
  harness's dispatch overhead;
- *spawn per case*: ``--spawn-cases`` times a fresh pool (spawn, imports, process-group set-up), one
  case, shutdown; what a harness that spawns per test pays.

``python -m harness bench`` prints both and checks the warm overhead against the targets (below
100 ms per case on CPU with gloo, below 50 ms on GPUs with NCCL); exit status 1 when it misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.cli.options import add_placement
from harness.ranks.placement import PlacementError, n_gpus, place, xdist_worker
from harness.ranks.pool import PoolConfig, RankPool
from harness.ranks.rank import RankContext

#: the targets of the warm per-case overhead, by backend.
TARGET_MS = {"gloo": 100.0, "nccl": 50.0}


def trivial_case(ctx: RankContext, payload: int) -> int:
    """The benchmark's case: one all-reduce, so every case crosses the process group."""
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return int(t.item())


@dataclass
class BenchResult:
    backend: str
    world_size: int
    #: seconds per case, each measured case.
    warm_s: list[float]
    spawn_s: list[float]

    @property
    def warm_ms(self) -> float:
        return 1000 * statistics.mean(self.warm_s)

    @property
    def spawn_ms(self) -> float:
        return 1000 * statistics.mean(self.spawn_s)

    @property
    def target_ms(self) -> float:
        return TARGET_MS[self.backend]

    @property
    def meets_target(self) -> bool:
        return self.warm_ms < self.target_ms


def measure(config: PoolConfig, warm_cases: int, spawn_cases: int) -> BenchResult:
    """Time ``warm_cases`` cases on one warm pool and ``spawn_cases`` pools spawned for one case each."""
    warm: list[float] = []
    with RankPool(config) as pool:
        _expect_ok(pool.run(trivial_case, -1), config)  # start-up is not per-case cost
        for i in range(warm_cases):
            t0 = time.perf_counter()
            _expect_ok(pool.run(trivial_case, i), config)
            warm.append(time.perf_counter() - t0)
    spawn: list[float] = []
    spawned = dataclasses.replace(config, start_method="spawn")  # as torch's harness starts its ranks
    for i in range(spawn_cases):
        t0 = time.perf_counter()
        with RankPool(spawned) as pool:
            _expect_ok(pool.run(trivial_case, i), config)
        spawn.append(time.perf_counter() - t0)
    return BenchResult(config.backend, config.world_size, warm, spawn)


def _expect_ok(outcome: object, config: PoolConfig) -> None:
    status = getattr(outcome, "status", None)
    values = getattr(outcome, "values", None)
    if status != "ok" or values != [config.world_size] * config.world_size:
        raise RuntimeError(f"bench: the trivial case failed: {outcome}")


def report(result: BenchResult) -> str:
    from tabulate import tabulate

    rows = [
        ("warm pool", len(result.warm_s), f"{result.warm_ms:.2f}", f"{1000 * max(result.warm_s):.2f}"),
        ("spawn per case", len(result.spawn_s), f"{result.spawn_ms:.1f}", f"{1000 * max(result.spawn_s):.1f}"),
    ]
    table = tabulate(rows, headers=("mode", "cases", "mean ms/case", "max ms/case"))
    verdict = "meets" if result.meets_target else "MISSES"
    return (
        f"{result.world_size} ranks, {result.backend}\n{table}\n"
        f"warm pool overhead {result.warm_ms:.2f} ms/case {verdict} the target of < {result.target_ms:g} ms; "
        f"spawning per case costs {result.spawn_ms / max(result.warm_ms, 1e-9):.0f}x more"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2)
    add_placement(p)
    p.add_argument("--warm-cases", type=int, default=50, help="cases timed on the warm pool")
    p.add_argument("--spawn-cases", type=int, default=3, help="pools spawned for one case each")


def main(args: argparse.Namespace) -> int:
    worker, workers = xdist_worker()
    try:
        lane = place(args.world_size, n_gpus(), args.backend, args.device, worker, workers)
    except PlacementError as exc:
        print(f"harness bench: {exc}", file=sys.stderr)
        return 2
    config = PoolConfig(world_size=args.world_size, backend=lane.backend, devices=lane.devices, case_timeout_s=120)
    result = measure(config, args.warm_cases, args.spawn_cases)
    print(report(result))
    sys.stdout.flush()
    return 0 if result.meets_target else 1
