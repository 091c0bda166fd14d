"""The rank pool: reuse, the watchdog (hang -> timeout with every rank's stack, dead rank -> crash),
errors, respawn, Ctrl-C, and the communication trace running inside it.

The hang and crash cases are parity cases with an injected fault, so they travel the same path
as every real case; the case after each must pass on the respawned pool.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import harness_jobs
import pytest
import torch
from harness_jobs import FAULT_TIMEOUT_S, HEALTHY

from harness.cases.case import CaseConfig
from harness.compare.parity import record_from_outcome, run_case_on_rank
from harness.ranks.pool import PoolConfig, RankPool
from harness.ranks.rank_process import KEEP_RESERVED_BYTES, release_cached_memory


ROOT = Path(__file__).resolve().parents[2]


def _fault(name: str) -> CaseConfig:
    return HEALTHY.replace(extras=(("fault", name),))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; only the parent's reaping would remove it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


#: the healthy case after a fault runs on freshly spawned ranks, whose first case imports the engines:
#: on a loaded host (pytest-xdist workers) that alone can outlast the fault pool's short timeout.
HEALTHY_TIMEOUT_S = 120.0


def _assert_healthy_case(pool: RankPool) -> None:
    record = record_from_outcome(HEALTHY, pool.run(run_case_on_rank, HEALTHY, timeout_s=HEALTHY_TIMEOUT_S))
    assert record.verdict == "pass", record.reason


def test_ranks_are_reused_and_answer_per_rank(fault_pool: RankPool) -> None:
    first = fault_pool.run(harness_jobs.identity, "a")
    second = fault_pool.run(harness_jobs.identity, "b")
    assert first.status == second.status == "ok"
    assert [v["rank"] for v in first.values] == [0, 1]
    assert all(v["sum"] == 1.0 and v["world_size"] == 2 for v in first.values)
    assert [v["pid"] for v in first.values] == [v["pid"] for v in second.values], "the pool respawned between cases"
    assert [v["payload"] for v in second.values] == ["b", "b"]
    assert second.pool_start_s == 0.0  # a pool already up: its start belongs to the job that set it off


def test_an_unpicklable_job_is_refused_before_any_rank_sees_it(fault_pool: RankPool) -> None:
    with pytest.raises(TypeError, match="picklable"):
        fault_pool.run(lambda ctx, payload: None, None)
    assert fault_pool.run(harness_jobs.identity, None).status == "ok"


def test_a_skipped_collective_is_a_timeout_with_every_rank_stack(fault_pool: RankPool) -> None:
    starts = fault_pool.starts
    case = _fault("skip_collective_on_rank1")
    t0 = time.monotonic()
    outcome = fault_pool.run(run_case_on_rank, case)
    elapsed = time.monotonic() - t0
    record = record_from_outcome(case, outcome)
    assert record.verdict == "timeout", record.reason
    assert FAULT_TIMEOUT_S <= elapsed < FAULT_TIMEOUT_S + 8, elapsed
    # Rank 1 went on to the case's next collective, which rank 0 never reaches: both hang.
    assert "rank(s) [0, 1]" in record.reason and "all_reduce, called from parity.py" in record.reason
    stacks = record.detail["stacks"]
    assert set(stacks) == {"0", "1"}
    assert "_inject_fault" in stacks["0"]  # rank 0 hangs in the collective rank 1 skipped
    assert "run_case_on_rank" in stacks["1"] and "_inject_fault" not in stacks["1"]
    # The next job starts the ranks again, outside its wall time: its record keeps that start apart.
    respawned = fault_pool.run(run_case_on_rank, HEALTHY, timeout_s=HEALTHY_TIMEOUT_S)
    assert fault_pool.starts == starts + 1 and respawned.pool_start_s > 0
    healthy = record_from_outcome(HEALTHY, respawned)
    assert healthy.verdict == "pass" and healthy.detail["pool_start_s"] == respawned.pool_start_s, healthy.reason


def test_a_rank_hanging_in_forward_is_named_not_the_rank_waiting_for_it(fault_pool: RankPool) -> None:
    case = _fault("hang_in_forward_rank1")
    outcome = fault_pool.run(run_case_on_rank, case)
    record = record_from_outcome(case, outcome)
    assert record.verdict == "timeout", record.reason
    assert "rank(s) [0, 1]" in record.reason
    # Rank 0 waits in a collective for rank 1, which never left its forward: rank 1 is the one named.
    assert "rank 1 is behind, at parity.py:" in record.reason and "_hang_in_forward" in record.reason, record.reason
    assert "rank(s) [0] wait for it" in record.reason
    assert "_hang_in_forward" in outcome.stacks[1] and "_hang_in_forward" not in outcome.stacks[0]
    _assert_healthy_case(fault_pool)


def test_a_rank_that_exits_is_a_crash_with_its_exit_code_and_stderr(fault_pool: RankPool) -> None:
    case = _fault("exit_rank1")
    record = record_from_outcome(case, fault_pool.run(run_case_on_rank, case))
    assert record.verdict == "crash"
    assert record.reason.startswith("rank 1 exited with code 3")
    assert record.detail["exit_codes"] == {"1": 3}
    assert "injected fault exit_rank1" in record.detail["stderr_tails"]["1"]
    _assert_healthy_case(fault_pool)


def test_a_segfault_is_a_crash_with_the_signal_and_the_fault_stack(fault_pool: RankPool) -> None:
    case = _fault("segfault_rank1")
    record = record_from_outcome(case, fault_pool.run(run_case_on_rank, case))
    assert record.verdict == "crash"
    assert "killed by SIGSEGV" in record.reason
    assert "Segmentation fault" in record.detail["stderr_tails"]["1"]
    assert "_inject_fault" in record.detail["stderr_tails"]["1"]  # faulthandler's stack of the dying rank
    # The healthy case, not a bare job: it also warms the respawned ranks (imports the engines), so the
    # next test's short timeout never pays that start-up on a loaded machine.
    _assert_healthy_case(fault_pool)


def test_one_rank_raising_while_the_other_waits_is_an_error_and_resets_the_pool(fault_pool: RankPool) -> None:
    starts = fault_pool.starts
    case = _fault("raise_rank1")
    outcome = fault_pool.run(run_case_on_rank, case)
    record = record_from_outcome(case, outcome)
    assert record.verdict == "error"
    assert record.reason.startswith("rank 1: RuntimeError: injected fault raise_rank1")
    assert "then stuck" in record.reason and outcome.pool_reset
    assert "raise_rank1" in record.detail["tracebacks"]["1"]
    assert "0" in record.detail["stacks"]
    _assert_healthy_case(fault_pool)
    assert fault_pool.starts == starts + 1


def test_every_rank_raising_is_an_error_and_keeps_the_pool(fault_pool: RankPool) -> None:
    pids = [v["pid"] for v in fault_pool.run(harness_jobs.identity, None).values]
    outcome = fault_pool.run(harness_jobs.raise_everywhere, None)
    assert outcome.status == "error" and not outcome.pool_reset
    assert outcome.reason == "rank 0: ValueError: raised on purpose by rank 0"
    assert set(outcome.errors) == {0, 1}
    assert [v["pid"] for v in fault_pool.run(harness_jobs.identity, None).values] == pids


def test_a_hang_outside_collectives_times_out_too(fault_pool: RankPool) -> None:
    outcome = fault_pool.run(harness_jobs.sleep_forever, None, timeout_s=1.0)
    assert outcome.status == "timeout" and outcome.pool_reset
    assert all("sleep_forever" in outcome.stacks[r] for r in (0, 1))
    assert fault_pool.run(harness_jobs.identity, None).status == "ok"


def test_the_trace_records_each_collective_once_and_restores_torch(fault_pool: RankPool) -> None:
    outcome = fault_pool.run(harness_jobs.trace_collectives, None)
    assert outcome.status == "ok", outcome.reason
    for value in outcome.values:
        assert value["patched_inside"] and value["restored"]
        seen = [(e["op"], e["numel"], e["dtype"], e["phase"], e["step"], e["group_size"]) for e in value["events"]]
        assert seen == [
            ("all_gather", 4, "float32", "forward", 0, 2),
            ("reduce_scatter", 4, "float32", "backward", 0, 2),
            ("all_reduce", 3, "float64", "backward", 0, 2),
            ("all_gather", 8, "float32", "backward", 0, 2),
            ("broadcast", 5, "bfloat16", "step", 1, 2),
        ]
        assert value["events"][2]["nbytes"] == 24


def _gone(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to ``within_s`` for them to go."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups of ranks: Linux")
def test_what_a_job_started_ends_with_the_ranks_killed_or_closed() -> None:
    # A child a job started (an engine's forward starting a process) would outlive its rank and hold the
    # run's pipes: each rank leads its own process group, and the pool kills the group with the rank.
    with RankPool(PoolConfig(world_size=2, case_timeout_s=120.0)) as pool:
        started = pool.run(harness_jobs.start_child, None)
        assert started.status == "ok", started.reason
        children = list(started.values)
        assert all(_alive(p) for p in children)
        assert pool.run(harness_jobs.sleep_forever, None, timeout_s=1.0).pool_reset  # the watchdog kills the ranks
        assert not _gone(children), "children of killed ranks outlived them"
        started = pool.run(harness_jobs.start_child, None)
        assert started.status == "ok", started.reason
        children = list(started.values)
    assert not _gone(children), "children of closed ranks outlived them"


_CHILD = textwrap.dedent(
    """
    import faulthandler, signal, sys
    sys.path[:0] = {paths!r}
    # Ctrl-C as in a terminal, whatever this process inherited: a background job of a non-interactive shell
    # starts with SIGINT ignored, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The test asks for this process's stacks with SIGUSR1 if it outlives the signal it was sent.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import harness_jobs
    from harness.ranks.pool import PoolConfig, RankPool

    if __name__ == "__main__":
        pool = RankPool(PoolConfig(world_size=2, case_timeout_s=600))
        try:
            pids = [v["pid"] for v in pool.run(harness_jobs.identity, None).values]
            print(" ".join(map(str, pids)), flush=True)
            pool.run(harness_jobs.sleep_forever, None)
        finally:
            pool.close()
    """
)


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_ctrl_c_or_a_killed_parent_leaves_no_rank_behind(tmp_path: Path, run_tmp: Path, how: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(paths=[str(ROOT), str(Path(__file__).parent)]))
    # A parent killed with SIGKILL cannot remove the pool's directory: keep it in a directory of the test's.
    env = {**os.environ, "TMPDIR": str(run_tmp)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"child printed {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        assert all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # where it hangs, for the failure message
            time.sleep(2)
            proc.kill()
            pytest.fail(f"the parent outlived {how} by 30 s; its stacks then:\n{proc.communicate()[1][-6000:]}")
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), f"ranks {[p for p in pids if _alive(p)]} outlived the parent ({how})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_CHILD_SIGNALLED_ELSEWHERE = textwrap.dedent(
    """
    import signal, sys, threading, time
    sys.path[:0] = {paths!r}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever was inherited
    import harness_jobs
    from harness.ranks.pool import PoolConfig, RankPool

    def interrupt_from_this_thread():
        time.sleep(1.0)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    if __name__ == "__main__":
        pool = RankPool(PoolConfig(world_size=2, case_timeout_s=600))
        try:
            pool.run(harness_jobs.identity, None)
            threading.Thread(target=interrupt_from_this_thread, daemon=True).start()
            started = time.monotonic()
            try:
                pool.run(harness_jobs.sleep_forever, None)
            except KeyboardInterrupt:
                print(f"interrupted after {{time.monotonic() - started:.1f}} s", flush=True)
        finally:
            pool.close()
    """
)


def test_ctrl_c_that_the_kernel_hands_to_another_thread_still_stops_the_wait(tmp_path: Path, run_tmp: Path) -> None:
    # A process-wide SIGINT may be delivered to any thread that does not block it (the TCPStore's server
    # thread, a lane): Python's handler then only flags it, and a main thread asleep in a long wait on the
    # ranks would not see it until the case's timeout. Sent to a side thread on purpose here.
    script = tmp_path / "child.py"
    script.write_text(_CHILD_SIGNALLED_ELSEWHERE.format(paths=[str(ROOT), str(Path(__file__).parent)]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(run_tmp)})
    assert done.returncode == 0 and done.stdout.startswith("interrupted after "), done.stdout + done.stderr[-3000:]
    assert float(done.stdout.split()[2]) < 5.0, done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_whose_owner_died_before_it_armed_the_watch_exits() -> None:
    # A spawned rank imports torch before it arms the watch; were its owner killed meanwhile, the rank
    # would wait on the dead owner's store while holding the owner's pipes. The owner's pid it was
    # started by is no longer its parent then: it exits at once.
    code = ("import os, sys; from harness.ranks.rank_process import die_with_parent; "
            "die_with_parent(os.getppid()); print('armed', flush=True); die_with_parent(os.getppid() + 10**7); print('alive')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, "armed\n"), done.stderr


def test_pool_config_validates() -> None:
    with pytest.raises(ValueError, match="world_size"):
        PoolConfig(world_size=0)
    with pytest.raises(ValueError, match="one device per rank"):
        PoolConfig(world_size=2, devices=(0,))
    with pytest.raises(ValueError, match="nccl"):
        PoolConfig(world_size=2, backend="nccl")


def test_a_cpu_rank_has_no_cached_memory_to_release() -> None:
    assert release_cached_memory(torch.device("cpu")) is False


@pytest.mark.gpu
def test_a_rank_returns_a_large_case_s_cached_gpu_memory_before_the_next_case(gpu_pool: RankPool) -> None:
    """Idle ranks of long-lived pools must not keep their largest case's blocks: under xdist the GPU is
    shared by every worker's pools, and held blocks ran the next case out of memory."""
    big = 2 * KEEP_RESERVED_BYTES
    during = gpu_pool.run(harness_jobs.reserve_and_drop, big)
    assert during.status == "ok" and all(v >= big for v in during.values), during.values
    after = gpu_pool.run(harness_jobs.reserved_bytes, None)
    assert after.status == "ok" and all(v <= KEEP_RESERVED_BYTES for v in after.values), after.values
