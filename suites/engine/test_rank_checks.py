"""The rank checks the engine and ported suites run their checks as (``harness.pytest_plugin.rank_checks``, on
``harness.ranks.pool.RankPool``): a failure names the rank and keeps its traceback, a skip needs every rank,
and the checks after a failure still run; ``--device`` narrows checks run on both devices, and an
expected failure is a strict xfail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.pytest_plugin.rank_checks import run_checks

REPO = Path(__file__).resolve().parents[2]


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


#: A scratch suite: rank checks on both devices, and one per engine whose expected failures are planted.
_SCRATCH_DEVICES = '''
from harness.pytest_plugin.rank_checks import rank_check_tests


def check_ok(rank, world_size):
    pass


rank_checks, test_check = rank_check_tests([check_ok], device=("cpu", "cuda"))
'''
_SCRATCH_KNOWN = '''
from pathlib import Path

from harness.collect.expectations import ExpectedFailure
from harness.pytest_plugin.rank_checks import api_rank_check_tests


def check_fails(api, rank, world_size):
    assert False, "planted failure"


def check_passes(api, rank, world_size):
    pass


def check_counts_its_batch(api, rank, world_size):
    # One line per spawn of a batch's ranks: a batch split over workers runs its fixture once on each.
    if rank == 0:
        with open(Path(__file__).with_name("batches.txt"), "a") as f:
            f.write(f"{api}\\n")


KNOWN = (
    ExpectedFailure("planted: the engine gets this wrong", engine="builtin", device="cpu", checks=("check_fails",)),
    ExpectedFailure("planted: said to fail, but passes", engine="builtin", device="cpu", checks=("check_passes",)),
)
rank_checks, test_check = api_rank_check_tests([check_fails, check_passes, check_counts_its_batch], lambda spec: spec,
                                               expected_failures=KNOWN)
'''


_SCRATCH_SHARED = '''
from pathlib import Path

import pytest

from harness.pytest_plugin.xdist_groups import one_worker


@pytest.fixture(scope="module")
@one_worker
def costly():
    with open(Path(__file__).with_name("batches.txt"), "a") as f:
        f.write("costly\\n")


@pytest.mark.parametrize("i", range(4))
def test_uses_it(costly, i):
    pass
'''


def _scratch_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["harness.pytest_plugin"]\n')
    (tmp_path / "test_devices.py").write_text(_SCRATCH_DEVICES)
    (tmp_path / "test_known.py").write_text(_SCRATCH_KNOWN)
    (tmp_path / "test_shared.py").write_text(_SCRATCH_SHARED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-rA", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_device_option_narrows_rank_checks_and_expected_failures_are_strict(tmp_path: Path) -> None:
    done = _scratch_run(tmp_path, "--engine", "builtin", "--device", "cpu")
    out = done.stdout
    assert "PASSED test_devices.py::test_check[on_cpu-check_ok]" in out, out[-3000:]
    assert "--device cpu: the cuda rank checks are not selected" in out, out[-3000:]
    # A known failure is an xfail with its reason; one that passes fails the run (strict).
    assert "XFAIL test_known.py::test_check[builtin-check_fails]" in out and "the engine gets this wrong" in out, out[-3000:]
    assert "FAILED test_known.py::test_check[builtin-check_passes]" in out and "XPASS(strict)" in out, out[-3000:]
    assert done.returncode == 1, out[-3000:]


def test_each_check_test_may_take_its_module_s_whole_batch_under_pytest_timeout() -> None:
    """The first test's set-up runs every check of the module; pytest-timeout's per-test limit must not end
    it while each check is within the pool's own watchdog."""
    from harness.pytest_plugin.rank_checks import rank_check_tests
    from harness.ranks.pool import PoolConfig

    _, test_check = rank_check_tests([check_all_reduce, check_fails_on_rank1], timeout_s=50.0)
    limits = [m.args[0] for m in test_check.pytestmark if m.name == "timeout"]
    assert limits == [2 * 50.0 + PoolConfig.start_timeout_s], test_check.pytestmark


def test_each_engine_and_device_batch_is_its_own_xdist_group(tmp_path: Path) -> None:
    """A module's batches (one per engine and device, each spawning its own ranks) may run on different
    pytest-xdist workers side by side; the checks of one batch stay together, as do the tests of any other
    fixture marked ``one_worker``."""
    done = _scratch_run(tmp_path, "-n", "2", "--dist", "loadgroup", "-v", "--engine", "builtin,torch-fsdp")
    groups = {line.split("@", 1)[1].split()[0] for line in done.stdout.splitlines()
              if ("PASSED" in line or "XFAIL" in line or "SKIPPED" in line or "FAILED" in line) and "@" in line}
    assert groups == {
        "shared:test_known:rank_checks/fsdp_api=builtin", "shared:test_known:rank_checks/fsdp_api=torch-fsdp",
        "shared:test_devices:rank_checks/rank_checks=cpu", "shared:test_devices:rank_checks/rank_checks=cuda",
        "shared:test_shared:costly",
    }, done.stdout[-3000:]
    # Each fixture instance was set up once: its tests all went to the worker that set it up.
    assert sorted((tmp_path / "batches.txt").read_text().split()) == ["builtin", "costly", "torch-fsdp"], done.stdout[-3000:]
