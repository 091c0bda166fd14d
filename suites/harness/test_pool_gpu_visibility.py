"""Pools started side by side from threads: a CPU pool hides the GPUs from its ranks only.

A CPU pool hides the GPUs by changing the environment its children inherit, which is process-wide:
a GPU pool started from another thread at that moment (pytest-xdist lanes, a nightly's pools) once
started with no GPU ("No CUDA GPUs are available" on a 4-GPU node under ``-n 16``). No GPU is needed
to see it: the children report the variable they were started with.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from harness.ranks.pool import gpus_hidden
from suites.harness.visible_devices import report_visible_devices

VISIBLE = "0,1,2,3"


#: seconds a child gets to report; a child that never reports fails the test instead of hanging the worker.
REPORT_S = 60


def _start_and_read(hide: bool, seen: list[str | None]) -> None:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=report_visible_devices, args=(child,), daemon=True)
    with gpus_hidden(hide):
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

    def starts(hide: bool, seen: list[str | None]) -> None:
        for _ in range(rounds):
            _start_and_read(hide, seen)

    # Daemon threads: one stuck in a start cannot keep the pytest worker from exiting.
    threads = [threading.Thread(target=starts, args=(hide, seen), daemon=True) for hide, seen in
               ((True, hidden), (False, shown), (True, hidden), (False, shown))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * rounds * REPORT_S)
    assert not any(t.is_alive() for t in threads), "a process start did not return"
    assert len(hidden) == len(shown) == 2 * rounds
    assert set(hidden) == {""}, hidden
    assert set(shown) == {VISIBLE}, f"a child started beside a CPU pool saw CUDA_VISIBLE_DEVICES={shown}"
