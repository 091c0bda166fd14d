"""The rank sessions the engine and seed suites run their checks in (``suites.engine.ranks``, on
``harness.pool.RankPool``): a failure names the rank and keeps its traceback, a skip needs every rank,
and the checks after a failure still run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from suites.engine.ranks import run_checks


def check_all_reduce(rank: int, world_size: int) -> None:
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    assert x.item() == world_size * (world_size + 1) / 2


def check_fails_on_rank1(rank: int, world_size: int) -> None:
    assert rank != 1, "planted failure on rank 1"


def check_skips(rank: int, world_size: int) -> None:
    pytest.skip(reason="feature missing here")


def test_failures_skips_and_later_checks() -> None:
    outcomes = run_checks([check_fails_on_rank1, check_skips, check_all_reduce], world_size=2, timeout_s=60)
    failed = outcomes["check_fails_on_rank1"]
    assert not failed.passed and failed.errors[0] is None and "planted failure on rank 1" in (failed.errors[1] or "")
    assert outcomes["check_skips"].passed and outcomes["check_skips"].skip_reason == "feature missing here"
    assert outcomes["check_all_reduce"].passed, outcomes["check_all_reduce"].report()
