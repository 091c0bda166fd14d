"""Pools started side by side from threads: each pool's ranks see the GPUs it was given, a CPU pool none.

A CPU pool hides the GPUs by changing the environment its children inherit, which is process-wide:
a GPU pool started from another thread at that moment (pytest-xdist lanes, a nightly's pools) once
started with no GPU ("No CUDA GPUs are available" on a 4-GPU node under ``-n 16``). No GPU is needed
to see it: the children report the variable they were started with.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from harness.ranks.placement import rank_device_index, rank_visible_devices
from harness.ranks.pool import gpus_for_ranks
from suites.harness.visible_devices import report_visible_devices

VISIBLE = "0,1,2,3"


#: seconds a child gets to report; a child that never reports fails the test instead of hanging the worker.
REPORT_S = 60


def _start_and_read(devices: tuple[int, ...] | None, seen: list[str | None]) -> None:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=report_visible_devices, args=(child,), daemon=True)
    with gpus_for_ranks(devices):
        proc.start()
    child.close()
    try:
        seen.append(parent.recv() if parent.poll(REPORT_S) else f"no report (exit code {proc.exitcode})")
    except EOFError:
        seen.append(f"no report (exit code {proc.exitcode})")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def test_gpu_pools_started_beside_cpu_pools_see_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE)
    hidden: list[str | None] = []
    shown: list[str | None] = []
    rounds = 6

    def starts(devices: tuple[int, ...] | None, seen: list[str | None]) -> None:
        for _ in range(rounds):
            _start_and_read(devices, seen)

    # Daemon threads: one stuck in a start cannot keep the pytest worker from exiting.
    own: list[str | None] = []
    # A CPU pool, gloo ranks sharing GPU 1 (they see the parent's GPUs), NCCL ranks on GPUs 3 and 1.
    threads = [threading.Thread(target=starts, args=(devices, seen), daemon=True) for devices, seen in
               ((None, hidden), ((1, 1), shown), (None, hidden), ((3, 1), own))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * rounds * REPORT_S)
    assert not any(t.is_alive() for t in threads), "a process start did not return"
    assert len(hidden) == 2 * rounds and len(shown) == len(own) == rounds
    assert set(hidden) == {""}, hidden
    assert set(shown) == {VISIBLE}, f"a child started beside a CPU pool saw CUDA_VISIBLE_DEVICES={shown}"
    assert set(own) == {"3,1"}, own


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
