"""The mixed-precision tests' rank pools (pytest fixtures): two gloo CPU ranks, or two ranks on the GPUs.

Package-scoped: where a collector's ``conftest.py`` imports them (``suites/mixed_precision``), one pool
serves every test module of the folder; a module that imports them (``pytest --pyargs``) starts its own.
"""

from __future__ import annotations

from harness.pytest_plugin.pools import rank_pool_fixture

__all__ = ["cpu_pair", "gpu_pair"]

#: the torch tests this suite ports run on two ranks: on the GPUs (NCCL with one GPU per rank, or gloo
#: ranks sharing one: ``harness.ranks.placement.place``) or on two gloo CPU ranks.
WORLD = 2

cpu_pair = rank_pool_fixture(WORLD, "cpu", timeout_s=240.0, scope="package", doc="Two gloo ranks on CPU.")
gpu_pair = rank_pool_fixture(WORLD, "cuda", timeout_s=240.0, scope="package",
                             doc="Two ranks on this worker's GPUs (one each, or sharing one).")
