"""Rank pools of a test module's own: the one factory of pool fixtures, and the pool a rank session runs on.

The generated cases share the plugin's pools (``parity_pools``: one per world size for the whole pytest
process, obeying ``--backend`` and ``--device``); a module whose tests need ranks of their own, started
for it and closed after it, declares them here::

    cpu_pair = rank_pool_fixture(2, "cpu", timeout_s=120.0)
    gpu_pair = rank_pool_fixture(2, "cuda", timeout_s=120.0, doc="Two ranks on this worker's GPUs.")

A pool is placed by ``harness.ranks.placement.place`` (``cuda``: this worker's GPUs, one per rank or shared
through gloo; ``cpu``: gloo ranks on the CPU even on a GPU host; ``auto``: the GPUs where there are any);
a CUDA pool skips its tests, saying why, on a host without a GPU. The rank sessions
(``harness.conformance.rank_sessions``) start theirs with :func:`placed_pool` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.pytest_plugin import gpus_missing
from harness.ranks.placement import DeviceChoice
from harness.ranks.pool import PoolConfig, RankPool

__all__ = ["placed_pool", "rank_pool_fixture"]

_WHERE = {"cpu": "gloo CPU ranks", "cuda": "ranks on this worker's GPUs (one each, or sharing one)",
          "auto": "ranks where harness.ranks.placement.place puts them (the GPUs where there are any)"}


@contextlib.contextmanager
def placed_pool(world_size: int, device: DeviceChoice = "auto", *, timeout_s: float, **config: Any) -> Iterator[RankPool]:
    """``world_size`` ranks on ``device`` (``case_timeout_s=timeout_s``; ``config``: more ``PoolConfig``
    fields), started on entry and closed on exit; skips the test on a host without GPUs for ``cuda``."""
    if device == "cuda" and (reason := gpus_missing(1)):
        pytest.skip(reason=reason)
    with RankPool(PoolConfig.placed(world_size, device=device, case_timeout_s=timeout_s, **config)) as pool:
        yield pool


def rank_pool_fixture(world_size: int, device: DeviceChoice = "auto", *, timeout_s: float, scope: str = "module",
                      doc: str | None = None, **config: Any) -> Callable[..., Iterator[RankPool]]:
    """A fixture of ``scope`` yielding :func:`placed_pool`'s pool; its name is the one the module binds it to."""

    def pool() -> Iterator[RankPool]:
        with placed_pool(world_size, device, timeout_s=timeout_s, **config) as started:
            yield started

    pool.__doc__ = doc or f"{world_size} {_WHERE[device]}, started once per {scope}."
    return pytest.fixture(scope=scope)(pool)  # type: ignore[arg-type]
