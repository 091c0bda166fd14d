"""Fixtures of the mixed-precision suites: rank pools, started once for the whole folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.pool import PoolConfig, RankPool
from harness.pytest_plugin import gpus_missing

#: the seed runs its multi-rank tests on two GPUs; the CPU lane runs them on two gloo ranks.
WORLD = 2


@pytest.fixture(scope="package")
def cpu_pair() -> Iterator[RankPool]:
    """Two gloo ranks on CPU."""
    with RankPool(PoolConfig(world_size=WORLD, backend="gloo", case_timeout_s=240.0)) as pool:
        yield pool


@pytest.fixture(scope="package")
def gpu_pair() -> Iterator[RankPool]:
    """Two NCCL ranks on GPUs 0 and 1."""
    if reason := gpus_missing(WORLD):
        pytest.skip(reason=reason)
    with RankPool(PoolConfig(world_size=WORLD, backend="nccl", devices=(0, 1), case_timeout_s=240.0)) as pool:
        yield pool

