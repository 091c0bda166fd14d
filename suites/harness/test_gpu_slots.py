"""GPU slots: pytest-xdist workers' NCCL ranks take turns on a GPU instead of crowding it
([Note: NCCL under time-slicing] in ``harness.ranks.gpu_slots``). The slots are plain file locks, so
they are checked here without a GPU: across processes, after a holder is killed, and for holders of
several GPUs taken in opposite rank order."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import harness_jobs
import pytest

from harness.ranks import gpu_slots
from harness.ranks.gpu_slots import GpuSlots, slot_needs
from harness.cases.case import CaseConfig
from harness.compare.parity import record_from_outcome
from harness.ranks.pool import PoolOutcome, RankPool

ROOT = Path(__file__).resolve().parents[2]


def test_only_nccl_ranks_take_slots_one_per_rank_in_gpu_order() -> None:
    assert slot_needs("gloo", (0, 0, 1, 1), 8) == []
    assert slot_needs("gloo", None, 8) == []
    assert slot_needs("nccl", (3, 1, 0, 2), 8) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    # One pool always fits, whatever the cap.
    assert slot_needs("nccl", (0, 0, 1), 1) == [(0, 1), (1, 1)]
    with pytest.raises(ValueError, match="per_gpu"):
        GpuSlots(Path("unused"), per_gpu=0)


def _holder(directory: Path, devices: tuple[int, ...], per_gpu: int) -> subprocess.Popen[str]:
    """A process that holds the slots of an NCCL pool on ``devices`` until its stdin closes."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from harness.ranks.gpu_slots import GpuSlots
        with GpuSlots(Path({str(directory)!r}), per_gpu={per_gpu}).hold("nccl", {devices!r}):
            print("held", flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _wait_in_thread(slots: GpuSlots, devices: tuple[int, ...]) -> tuple[threading.Thread, threading.Event]:
    got = threading.Event()

    def take() -> None:
        with slots.hold("nccl", devices):
            got.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, got


def test_a_full_gpu_makes_the_next_job_wait_until_a_process_releases_its_slot(tmp_path: Path) -> None:
    slots = GpuSlots(tmp_path, per_gpu=2)
    first, second = _holder(tmp_path, (0, 1), 2), _holder(tmp_path, (1,), 2)
    try:
        # GPU 0 has a free slot: a pool on GPU 0 alone runs at once.
        with slots.hold("nccl", (0,)) as waited:
            assert waited < 1.0
        thread, got = _wait_in_thread(slots, (0, 1))
        assert not got.wait(0.5), "took a third slot of GPU 1, which two processes hold"
        second.stdin.close()  # type: ignore[union-attr]
        second.wait(10)
        assert got.wait(10), "the slot a process released was not taken"
        thread.join(10)
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_a_killed_holder_leaves_its_slot_free(tmp_path: Path) -> None:
    slots = GpuSlots(tmp_path, per_gpu=1)
    holder = _holder(tmp_path, (0,), 1)
    thread, got = _wait_in_thread(slots, (0,))
    assert not got.wait(0.3)
    holder.kill()  # SIGKILL: no cleanup of its own runs
    holder.wait()
    assert got.wait(10), "the slot of a killed process stayed taken"
    thread.join(10)


def test_holders_of_several_gpus_in_opposite_rank_order_do_not_wait_on_each_other(tmp_path: Path) -> None:
    slots = GpuSlots(tmp_path, per_gpu=1)
    done = [0, 0]

    def loop(i: int, devices: tuple[int, ...]) -> None:
        for _ in range(50):
            with slots.hold("nccl", devices):
                time.sleep(0.001)
            done[i] += 1

    threads = [threading.Thread(target=loop, args=(0, (0, 1)), daemon=True),
               threading.Thread(target=loop, args=(1, (1, 0)), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert done == [50, 50], f"deadlocked after {done} jobs"


@dataclass(frozen=True)
class _SpySlots(GpuSlots):
    held: list[tuple[str, tuple[int, ...] | None]] = field(default_factory=list)

    def hold(self, backend, devices):  # type: ignore[no-untyped-def, override]
        self.held.append((backend, devices))
        return super().hold(backend, devices)


@pytest.fixture
def spy_slots(tmp_path: Path) -> Iterator[_SpySlots]:
    spy, before = _SpySlots(tmp_path), gpu_slots.installed()
    gpu_slots.install(spy)
    try:
        yield spy
    finally:
        gpu_slots.install(before)  # an xdist worker's own slots stay for its next tests


def test_every_job_of_a_pool_goes_through_the_installed_slots(fault_pool: RankPool, spy_slots: _SpySlots) -> None:
    outcome = fault_pool.run(harness_jobs.identity, "x")
    assert outcome.status == "ok"
    assert spy_slots.held == [(fault_pool.config.backend, fault_pool.config.devices)]


class _WaitedSlots(GpuSlots):
    """Slots that report a known wait, whatever the pool's backend."""

    @contextlib.contextmanager
    def hold(self, backend, devices):  # type: ignore[no-untyped-def, override]
        yield 1.5


def test_a_jobs_wait_for_its_slots_is_on_its_outcome_and_record(fault_pool: RankPool, tmp_path: Path) -> None:
    before = gpu_slots.installed()
    gpu_slots.install(_WaitedSlots(tmp_path))
    try:
        outcome = fault_pool.run(harness_jobs.identity, "x")
    finally:
        gpu_slots.install(before)
    assert outcome.status == "ok" and outcome.slot_wait_s == 1.5 and outcome.wall_s < 1.5
    timed_out = PoolOutcome("timeout", [None], "rank 0 did not answer", slot_wait_s=0.5)
    assert record_from_outcome(CaseConfig(), timed_out).detail == {"slot_wait_s": 0.5}
    assert "slot_wait_s" not in record_from_outcome(CaseConfig(), PoolOutcome("timeout", [None], "t")).detail


def test_a_process_a_test_starts_takes_its_slots_from_the_same_run(spy_slots: _SpySlots) -> None:
    """A ``harness run`` a test starts puts its pools on the same GPUs: its jobs must take the run's slots."""
    seen = subprocess.run(
        [sys.executable, "-c", "from harness.ranks import gpu_slots; s = gpu_slots.installed(); print(s.per_gpu, s.directory)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip() == f"{spy_slots.per_gpu} {spy_slots.directory}"
