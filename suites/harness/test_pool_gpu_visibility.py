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

from harness.pool import gpus_hidden
from suites.harness.visible_devices import report_visible_devices

VISIBLE = "0,1,2,3"


def _start_and_read(hide: bool, seen: list[str | None]) -> None:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=report_visible_devices, args=(child,), daemon=True)
    with gpus_hidden(hide):
        proc.start()
    child.close()
    seen.append(parent.recv())
    proc.join(timeout=30)


def test_gpu_pools_started_beside_cpu_pools_see_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE)
    hidden: list[str | None] = []
    shown: list[str | None] = []
    rounds = 6

    def starts(hide: bool, seen: list[str | None]) -> None:
        for _ in range(rounds):
            _start_and_read(hide, seen)

    threads = [threading.Thread(target=starts, args=(hide, seen)) for hide, seen in
               ((True, hidden), (False, shown), (True, hidden), (False, shown))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(hidden) == len(shown) == 2 * rounds
    assert set(hidden) == {""}, hidden
    assert set(shown) == {VISIBLE}, f"a child started beside a CPU pool saw CUDA_VISIBLE_DEVICES={shown}"
