"""Rank pools in pytest: the one way a test holds a group of rank processes.

Every group of rank processes a test runs on is held by a :class:`RankPools`: pools started on first use,
one per key (a world size), placed by one rule (``harness.ranks.placement.place``), a placement that cannot
run here or a start that failed twice remembered (every later user skips or fails with the same reason, and
nothing waits for the same start-up to fail again), the least recently used CUDA pools closed when more
ranks would not fit this worker's share of the machine, and all closed together. Its three uses:

- the generated cases share the plugin's ``parity_pools`` (``PoolRegistry``: a ``RankPools`` per pytest
  process, one pool per world size, obeying ``--backend`` and ``--device``), on which ``ParityRunner`` runs
  each case (``harness.run.runner.run_case``);
- the rank checks (``harness.pytest_plugin.rank_checks``: many checks of one test module in one set of rank
  processes) run their checks on :func:`placed_pool`'s pool, a ``RankPools`` of the module's own;
- a module whose tests need ranks of their own, started for it and closed after it, declares them here::

    cpu_pair = rank_pool_fixture(2, "cpu", timeout_s=120.0)
    gpu_pair = rank_pool_fixture(2, "cuda", timeout_s=120.0, doc="Two ranks on this worker's GPUs.")

A pool is placed by ``harness.ranks.placement.place`` (``cuda``: this worker's GPUs, one per rank or shared
through gloo; ``cpu``: gloo ranks on the CPU even on a GPU host; ``auto``: the GPUs where there are any);
a CUDA pool skips its tests, saying why, on a host without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from harness.ranks.placement import DeviceChoice

if TYPE_CHECKING:
    from harness.pytest_plugin.cases import ParityOptions, PoolPlan
    from harness.ranks.pool import PoolConfig, RankPool

__all__ = ["PoolRegistry", "RankPools", "START_ATTEMPTS", "gpus_missing", "placed_pool", "plan_here", "rank_pool_fixture", "skip_here"]

_WHERE = {"cpu": "gloo CPU ranks", "cuda": "ranks on this worker's GPUs (one each, or sharing one)",
          "auto": "ranks where harness.ranks.placement.place puts them (the GPUs where there are any)"}


def gpus_missing(n: int, why: str = "") -> str | None:
    """Why a test that needs ``n`` CUDA GPUs cannot run here; None when it can. Multi-rank tests need one
    GPU (``harness.ranks.placement.place`` shares it); only what measures NCCL itself needs one per rank,
    and says so in ``why``."""
    from harness.ranks.placement import n_gpus

    found = n_gpus()
    return None if found >= n else f"needs {n} CUDA GPU(s){f' ({why})' if why else ''}; this machine has {found}"


def skip_here(reason: str) -> NoReturn:
    """Skip the running test, reported at the test's own location rather than at this plugin's line
    (what pytest does for skip markers and skipping fixtures)."""
    raise pytest.skip.Exception(reason, _use_item_location=True)


def _n_workers() -> int:
    from harness.ranks.placement import xdist_worker

    return xdist_worker()[1]


def _overcommit_hint(exc: BaseException) -> str:
    """The option to change where ranks ran out of GPU memory at their start because this run has more
    xdist workers than the GPUs hold; "" otherwise."""
    from harness.ranks.placement import host_facts, xdist_overcommit

    if "out of memory" not in str(exc).lower():
        return ""
    overcommit = xdist_overcommit(host_facts(), _n_workers())
    return f" ({overcommit})" if overcommit else ""


def plan_here(world_size: int, options: "ParityOptions") -> "PoolPlan":
    """Where this pytest process's pool of ``world_size`` ranks runs under ``options`` (``plan_pool`` on
    this host's GPUs and this xdist worker's share of them)."""
    from harness.pytest_plugin.cases import plan_pool
    from harness.ranks.placement import n_gpus, xdist_worker

    worker, workers = xdist_worker()
    return plan_pool(world_size, options.backend, n_gpus(), worker, workers, options.device)


#: starts of one key's pool that may fail before every later test of it fails at once: one failed start
#: may be the machine's moment (ranks that did not join within the start timeout while a GPU host was
#: crowded: one worker's 18 later cases failed with it), two are not.
START_ATTEMPTS = 2

#: what a ``RankPools`` plan says of a key: the pool's configuration, or why no pool can run here (skip).
Plan = Callable[[Hashable], "PoolConfig | str"]


class RankPools:
    """Rank pools held for tests: one per key, started on first use, closed together (module docstring).

    ``plan(key)`` gives the pool's ``PoolConfig`` or the reason no pool can run here (the tests skip with
    it). ``start_now``: start a pool when it is first asked for, so that a start that fails fails that test
    (a second failed start, every later one at once: ``START_ATTEMPTS``); else it starts on its first job
    (``RankPool.run``). ``make_room``: close
    the least recently used CUDA pools until a new one fits ``harness.ranks.placement.cuda_rank_budget``.
    """

    def __init__(self, plan: Plan, *, start_now: bool = True, make_room: bool = True) -> None:
        self._plan = plan
        self.start_now = start_now
        self.make_room = make_room
        self._pools: dict[Hashable, RankPool] = {}
        #: why a key has no pool here: a plan that cannot run, or ``START_ATTEMPTS`` starts that failed.
        self._unavailable: dict[Hashable, tuple[str, str]] = {}
        self._failed_starts: dict[Hashable, int] = {}

    def pool_for(self, key: Hashable) -> "RankPool":
        """The pool for ``key``; skips the test (no place for it here) or fails it (ranks did not start)."""
        if key in self._unavailable:
            action, reason = self._unavailable[key]
            if action == "skip":
                skip_here(reason)
            pytest.fail(reason, pytrace=False)
        if key not in self._pools:
            config = self._plan(key)
            if isinstance(config, str):
                self._unavailable[key] = ("skip", config)
                skip_here(config)
            from harness.ranks.pool import PoolStartError, RankPool

            if config.devices is not None and self.make_room:
                self._room_for(config.world_size)
            pool = RankPool(config)
            if self.start_now:
                try:
                    pool.start()
                except PoolStartError as exc:
                    pool.close()
                    reason = f"the {config.world_size} ranks did not start: {exc}" + _overcommit_hint(exc)
                    self._failed_starts[key] = self._failed_starts.get(key, 0) + 1
                    if self._failed_starts[key] >= START_ATTEMPTS:
                        # Every later user of this key would wait for the same start-up to fail again.
                        self._unavailable[key] = ("fail", reason)
                    pytest.fail(reason, pytrace=False)
            self._pools[key] = pool
        self._pools[key] = self._pools.pop(key)  # most recently used last
        return self._pools[key]

    def _room_for(self, world_size: int) -> None:
        """Close the least recently used CUDA pools until ``world_size`` more CUDA ranks fit this worker's
        share of the GPU and host memory (``harness.ranks.placement.cuda_rank_budget``): with ``-n 8`` and
        world sizes up to 8 on one GPU, keeping every pool would hold over a hundred CUDA processes."""
        from harness.ranks.placement import cuda_rank_budget, host_facts, n_gpus

        budget = cuda_rank_budget(host_facts(), n_gpus(), _n_workers())
        if budget is None:
            return
        live = lambda: sum(p.config.world_size for p in self._pools.values() if p.config.devices is not None)  # noqa: E731
        for key in list(self._pools):
            if live() + world_size <= budget:
                break
            if self._pools[key].config.devices is not None:
                self._pools.pop(key).close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> "RankPools":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolRegistry(RankPools):
    """The rank pools of this pytest process's generated cases: one per world size, placed by the options
    (``plan_here``), started on first use, shared by every generated case, closed at the end of the session."""

    def __init__(self, options: "ParityOptions") -> None:
        self.options = options
        super().__init__(self._plan_size)

    def _plan_size(self, world_size: Hashable) -> "PoolConfig | str":
        from harness.ranks.pool import PoolConfig

        assert isinstance(world_size, int)
        plan = plan_here(world_size, self.options)
        if plan.skip_reason is not None:
            return plan.skip_reason
        return PoolConfig(world_size=world_size, backend=plan.backend, devices=plan.devices,  # type: ignore[arg-type]
                          case_timeout_s=self.options.case_timeout_s)


@contextlib.contextmanager
def placed_pool(world_size: int, device: DeviceChoice = "auto", *, timeout_s: float, **config: Any) -> Iterator["RankPool"]:
    """``world_size`` ranks on ``device`` (``case_timeout_s=timeout_s``; ``config``: more ``PoolConfig``
    fields), held by a ``RankPools`` of their own and closed on exit; skips the test on a host without GPUs
    for ``cuda``. The ranks start on the pool's first job."""
    from harness.ranks.pool import PoolConfig

    if device == "cuda" and (reason := gpus_missing(1)):
        pytest.skip(reason=reason)
    placed = PoolConfig.placed(world_size, device=device, case_timeout_s=timeout_s, **config)
    with RankPools(lambda _: placed, start_now=False, make_room=False) as pools:
        yield pools.pool_for(world_size)


def rank_pool_fixture(world_size: int, device: DeviceChoice = "auto", *, timeout_s: float, scope: str = "module",
                      doc: str | None = None, **config: Any) -> Callable[..., Iterator["RankPool"]]:
    """A fixture of ``scope`` yielding :func:`placed_pool`'s pool; its name is the one the module binds it to."""

    def pool() -> Iterator[RankPool]:
        with placed_pool(world_size, device, timeout_s=timeout_s, **config) as started:
            yield started

    pool.__doc__ = doc or f"{world_size} {_WHERE[device]}, started once per {scope}."
    return pytest.fixture(scope=scope)(pool)  # type: ignore[arg-type]
