"""Fixtures of the harness suites: rank pools for parity cases and for fault injection, and a ``run``
that records without ranks."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness_jobs import FAULT_TIMEOUT_S, HEALTHY

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.compare.parity import run_case_on_rank
from harness.pytest_plugin.pools import placed_pool, rank_pool_fixture
from harness.ranks.pool import RankPool

parity_pool = rank_pool_fixture(2, timeout_s=180.0, scope="session",
                                doc="Two ranks for parity cases, started once for the whole harness suite.")
gpu_pool = rank_pool_fixture(2, "cuda", timeout_s=300.0, doc=(
    "Two ranks on the GPUs, for the GPU-only tests: NCCL with one GPU each, or gloo with both on one GPU."))


@pytest.fixture
def run_tmp() -> Iterator[Path]:
    """A temporary directory with a short path, for a child process's ``TMPDIR``: its forkserver binds a Unix
    socket in it (107 bytes at most), which pytest's ``tmp_path`` (numbered runs, the test's name) can outgrow."""
    with tempfile.TemporaryDirectory(prefix="run-") as path:
        yield Path(path)


@pytest.fixture(scope="module")
def fault_pool() -> Iterator[RankPool]:
    """Two gloo CPU ranks with a short case timeout, for cases that hang, crash or raise."""
    with placed_pool(2, "cpu", timeout_s=FAULT_TIMEOUT_S, error_grace_s=2.0, stack_wait_s=2.0) as pool:
        # A first case imports the engines on the ranks; on a loaded host that alone can outlast the
        # short timeout, so it runs here, untimed by the tests (after a fault, the tests' healthy case
        # warms the respawned ranks the same way).
        warm = pool.run(run_case_on_rank, HEALTHY, timeout_s=120.0)
        assert warm.status == "ok", f"fault pool warm-up: {warm.reason}"
        yield pool


@pytest.fixture
def fake_run_case(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``run`` records every case as passed without starting ranks (the pools start lazily, on their
    first case); returns the full ids it ran."""
    import harness.run.runner as runner

    ran: list[str] = []

    def run_case(pool: Any, case: CaseConfig, timeout_s: float | None = None) -> CaseRecord:
        ran.append(case.full_id)
        return CaseRecord(case.to_dict(), case.case_id, "pass", reason="pass on purpose", time=time.time())

    monkeypatch.setattr(runner, "run_case", run_case)
    return ran
