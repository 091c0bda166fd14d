"""Fixtures for the wrap suites: the recording wrapper's log, the FSDP1 API under test and the rank pools.

The pools are module-scoped and do not depend on the engine: the checks of every engine in
``--engine`` (``fsdp_api``, parametrized by ``harness.pytest_plugin``) run on the same ranks, each job
loading its engine by name on the rank.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from wrap_models import RecordingUnit

from harness.pool import PoolConfig, RankPool
from harness.pytest_plugin import gpus_missing
from suites.seeds.api import FSDPApi, load_api

#: the torch tests this suite ports run their multi-rank tests on two ranks, on the GPUs (NCCL with one
#: GPU per rank, or gloo ranks sharing one: ``harness.placement.place``) or on two gloo CPU ranks.
GPU_WORLD = 2


@pytest.fixture(autouse=True)
def recorded() -> Iterator[list[RecordingUnit]]:
    """The units :class:`RecordingUnit` constructs during the test, in construction order."""
    RecordingUnit.constructed = []
    yield RecordingUnit.constructed
    RecordingUnit.constructed = []


@pytest.fixture(scope="module")
def api(fsdp_api: str) -> FSDPApi:
    """The FSDP1 names of the engine under test, for decisions the test process makes (offload skips)."""
    return load_api(fsdp_api)


def _pool(config: PoolConfig) -> Iterator[RankPool]:
    with RankPool(config) as pool:
        yield pool


@pytest.fixture(scope="module")
def cpu_pair() -> Iterator[RankPool]:
    """Two gloo ranks on CPU, started once for the module."""
    yield from _pool(PoolConfig(world_size=2, backend="gloo", case_timeout_s=120.0))


@pytest.fixture(scope="module")
def cpu_single() -> Iterator[RankPool]:
    """One gloo rank on CPU: the seed's world-size-1 default group."""
    yield from _pool(PoolConfig(world_size=1, backend="gloo", case_timeout_s=120.0))


@pytest.fixture(scope="module")
def gpu_pair() -> Iterator[RankPool]:
    """Two ranks on this worker's GPUs (one each, or sharing one)."""
    if reason := gpus_missing(1):
        pytest.skip(reason=reason)
    yield from _pool(PoolConfig.placed(GPU_WORLD, device="cuda", case_timeout_s=120.0))


@pytest.fixture(scope="module")
def gpu_single() -> Iterator[RankPool]:
    """One rank on this worker's first GPU."""
    if reason := gpus_missing(1):
        pytest.skip(reason=reason)
    yield from _pool(PoolConfig.placed(1, device="cuda", case_timeout_s=120.0))
