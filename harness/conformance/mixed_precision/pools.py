"""The mixed-precision tests' rank pools (pytest fixtures): two gloo CPU ranks, or two ranks on the GPUs.

Package-scoped: where a collector's ``conftest.py`` imports them (``suites/mixed_precision``), one pool
serves every test module of the folder; a module that imports them (``pytest --pyargs``) starts its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.pool import PoolConfig, RankPool
from harness.pytest_plugin import gpus_missing

__all__ = ["cpu_pair", "gpu_pair"]

#: the torch tests this suite ports run on two ranks: on the GPUs (NCCL with one GPU per rank, or gloo
#: ranks sharing one: ``harness.placement.place``) or on two gloo CPU ranks.
WORLD = 2


@pytest.fixture(scope="package")
def cpu_pair() -> Iterator[RankPool]:
    """Two gloo ranks on CPU."""
    with RankPool(PoolConfig(world_size=WORLD, backend="gloo", case_timeout_s=240.0)) as pool:
        yield pool


@pytest.fixture(scope="package")
def gpu_pair() -> Iterator[RankPool]:
    """Two ranks on this worker's GPUs (one each, or sharing one)."""
    if reason := gpus_missing(1):
        pytest.skip(reason=reason)
    with RankPool(PoolConfig.placed(WORLD, device="cuda", case_timeout_s=240.0)) as pool:
        yield pool
