"""Fixtures of the harness suites: rank pools for parity cases and for fault injection."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness_jobs import FAULT_TIMEOUT_S, HEALTHY

from harness.parity import run_case_on_rank
from harness.pool import PoolConfig, RankPool


def parity_config(world_size: int = 2) -> PoolConfig:
    """Where ``harness.placement.place`` puts ``world_size`` ranks on this worker: the GPUs (one per rank,
    or shared through gloo) where there are any, else gloo on CPU."""
    return PoolConfig.placed(world_size, case_timeout_s=180.0)


@pytest.fixture(scope="session")
def parity_pool() -> Iterator[RankPool]:
    """Two ranks for parity cases, started once for the whole harness suite."""
    with RankPool(parity_config()) as pool:
        yield pool


@pytest.fixture(scope="module")
def fault_pool() -> Iterator[RankPool]:
    """Two gloo CPU ranks with a short case timeout, for cases that hang, crash or raise."""
    config = PoolConfig(world_size=2, backend="gloo", case_timeout_s=FAULT_TIMEOUT_S, error_grace_s=2.0, stack_wait_s=2.0)
    with RankPool(config) as pool:
        # A first case imports the engines on the ranks; on a loaded host that alone can outlast the
        # short timeout, so it runs here, untimed by the tests (after a fault, the tests' healthy case
        # warms the respawned ranks the same way).
        warm = pool.run(run_case_on_rank, HEALTHY, timeout_s=120.0)
        assert warm.status == "ok", f"fault pool warm-up: {warm.reason}"
        yield pool
