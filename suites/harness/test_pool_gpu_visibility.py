"""The environment a pool's ranks start with: the parent's at the pool's start, with the pool's GPUs (none for a
CPU pool), whichever way the ranks start (spawned, or forked from a forkserver that started earlier).

A CPU pool once hid the GPUs by changing the parent's environment around its start, process-wide: a GPU pool
started from another thread at that moment (pytest-xdist lanes, a nightly's pools) started with no GPU ("No CUDA
GPUs are available" on a 4-GPU node under ``-n 16``). The ranks now take the environment the pool hands them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import harness_jobs
import pytest

from harness.ranks.forkserver import start_early, start_method, starts_early
from harness.ranks.placement import rank_device_index, rank_visible_devices
from harness.ranks.pool import PoolConfig, RankPool, rank_environment

VISIBLE = "0,1,2,3"


def test_a_pools_environment_is_the_parents_with_the_pools_gpus() -> None:
    parent = {"CUDA_VISIBLE_DEVICES": VISIBLE, "OTHER": "kept"}
    assert rank_environment(None, parent) == {"CUDA_VISIBLE_DEVICES": "", "OTHER": "kept"}, "a CPU pool sees no GPU"
    assert rank_environment((3, 1), parent)["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert rank_environment((1, 1), parent) == parent, "ranks sharing a GPU see the parent's GPUs"
    assert parent == {"CUDA_VISIBLE_DEVICES": VISIBLE, "OTHER": "kept"}, "the parent's mapping is left as it was"


def test_cpu_pools_fork_from_a_server_where_there_is_one_and_cuda_pools_are_spawned() -> None:
    assert start_method(None, ["fork", "spawn", "forkserver"]) == "forkserver"
    assert start_method((0, 1), ["fork", "spawn", "forkserver"]) == "spawn"
    assert start_method(None, ["spawn"]) == "spawn"


def test_a_command_whose_pools_are_cpu_ones_starts_the_forkserver_before_its_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_host, cpu_host = ["/dev/nvidia0"], []
    assert starts_early("run", [], {}, cpu_host) and starts_early("nightly", ["--out", "n"], {}, cpu_host)
    assert not starts_early("list", [], {}, cpu_host) and not starts_early("history", [], {}, cpu_host)
    assert not starts_early("run", [], {}, gpu_host), "a GPU host's pools are CUDA ones, spawned"
    assert starts_early("run", ["--device", "cpu"], {}, gpu_host)
    assert starts_early("certify", ["--device=cpu"], {}, gpu_host)
    assert starts_early("run", [], {"CUDA_VISIBLE_DEVICES": ""}, gpu_host)
    assert not starts_early("run", [], {"LOCAL_RANK": "0"}, cpu_host), "under torchrun the ranks are torchrun's"
    from multiprocessing import forkserver

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    start_early("run", ["--matrix", "smoke"])
    server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert server is not None and os.waitpid(server, os.WNOHANG) == (0, 0), "the server runs"


def _report(pool: RankPool, key: str) -> list[str | None]:
    outcome = pool.run(harness_jobs.environment, key, timeout_s=120)
    assert outcome.status == "ok", outcome.reason
    return list(outcome.values)


def test_pools_started_from_threads_hide_the_gpus_and_never_change_the_parents_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE)
    seen: dict[int, list[str | None]] = {}
    parent_values: set[str | None] = set()
    over = threading.Event()

    def watch() -> None:
        while not over.wait(0.001):
            parent_values.add(os.environ.get("CUDA_VISIBLE_DEVICES"))

    def start(index: int) -> None:
        with RankPool(PoolConfig(world_size=2, backend="gloo", devices=None)) as pool:
            seen[index] = _report(pool, "CUDA_VISIBLE_DEVICES")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        over.set()
        watcher.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a pool start did not return"
    assert seen == {0: ["", ""], 1: ["", ""]}, seen
    assert parent_values == {VISIBLE}, f"the parent's CUDA_VISIBLE_DEVICES changed while pools started: {parent_values}"


def test_ranks_start_with_the_environment_of_their_pools_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forkserver keeps the environment it started with; the ranks forked from it must not."""
    for value in ("first", "second"):
        monkeypatch.setenv("HARNESS_TEST_POOL_ENV", value)
        with RankPool(PoolConfig(world_size=2, backend="gloo", devices=None)) as pool:
            assert _report(pool, "HARNESS_TEST_POOL_ENV") == [value, value]


def test_ranks_with_a_gpu_each_compute_on_the_one_their_local_rank_names() -> None:
    """As under torchrun, rank r of a pool with one GPU per rank sees its pool's GPUs in rank order and
    computes on cuda:r, cuda:$LOCAL_RANK: DeepSpeed ZeRO-3 allocates on cuda:$LOCAL_RANK whatever device it
    was handed, and on a 4-GPU node under pytest-xdist a pool's GPUs are seldom 0 and 1."""
    assert rank_visible_devices((2, 3), None) == "2,3" and rank_visible_devices((3, 0), "4,5,6,7") == "7,4"
    assert rank_visible_devices((1, 0), "GPU-a, GPU-b") == "GPU-b,GPU-a", "UUIDs as the parent names them"
    assert [rank_device_index((2, 3), r) for r in (0, 1)] == [0, 1]
    assert rank_visible_devices(None, VISIBLE) == "", "a CPU pool sees no GPU"
    assert rank_visible_devices((0, 0), VISIBLE) is None and rank_device_index((1, 1), 1) == 1, "shared: as the parent"
    with pytest.raises(ValueError, match="devices=.*CUDA_VISIBLE_DEVICES='0,1'"):
        rank_visible_devices((2, 3), "0,1")


def test_the_forkserver_imports_ask_cuda_nothing() -> None:
    """The forkserver's imports must leave CUDA alone: a device count or a context made there would be every
    forked CPU rank's (torch._dynamo's device interface counts the CUDA devices at import)."""
    code = ("import sys, torch; from harness.ranks.forkserver import FORKSERVER_PRELOAD\n"
            "for name in FORKSERVER_PRELOAD: __import__(name)\n"
            "print(torch.cuda.is_initialized(), 'torch._dynamo' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.stdout.split() == ["False", "False"], done.stdout + done.stderr[-2000:]
