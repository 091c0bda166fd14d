"""The trace summary of ``harness perf --profile``: busy time, overlap and idle from known events."""

from __future__ import annotations

import gzip
import json

import pytest

from harness.perf.profile_summary import (
    STEP_MARK,
    GpuEvent,
    gpu_events,
    host_collectives,
    host_syncs,
    load_trace,
    step_breakdown,
    step_marks,
    summarize,
    summary_lines,
)


def _ev(name: str, stream: int, start: float, dur: float, cat: str = "kernel") -> GpuEvent:
    return GpuEvent(name, cat, stream, start, dur)


def test_overlap_idle_and_compute_stream_from_known_intervals() -> None:
    # Compute stream 7 busy [0, 100) and [150, 250); an all-gather on stream 20 at [80, 160):
    # 20 us of it under the first compute interval, 10 under the second, and it fills the gap
    # between them; a copy at [300, 350) leaves (250, 300) idle.
    events = [
        _ev("gemm", 7, 0, 100),
        _ev("ncclDevKernel_AllGather", 20, 80, 80),
        _ev("gemm", 7, 150, 100),
        _ev("Memcpy DtoH", 21, 300, 50, "gpu_memcpy"),
    ]
    s = summarize(events, steps=2)
    assert s.compute_stream == 7
    assert s.window_ms_per_step == pytest.approx(350e-3 / 2)
    assert s.idle_ms_per_step == pytest.approx(50e-3 / 2)  # (250, 300)
    assert s.comm_ms_per_step == pytest.approx(80e-3 / 2)
    assert s.comm_overlapped_ms_per_step == pytest.approx(30e-3 / 2)
    side = {st.stream: st for st in s.streams}
    assert side[20].overlapped_ms == pytest.approx(30e-3 / 2)
    assert side[21].overlapped_ms == 0
    assert side[7].top_kernel == "gemm"
    assert s.top_kernels[0] == ("gemm", 1.0, pytest.approx(200e-3 / 2))
    text = "\n".join(summary_lines("builtin-full_shard-rank0", s))
    assert "NCCL 0.04 ms/step, 0.01 ms of it under compute" in text


def test_serialized_communication_has_no_overlap() -> None:
    events = [_ev("gemm", 7, 0, 100), _ev("ncclKernel_ReduceScatter", 13, 100, 40), _ev("gemm", 7, 140, 10)]
    s = summarize(events, steps=1)
    assert s.comm_overlapped_ms_per_step == 0
    assert s.idle_ms_per_step == 0


def test_reads_torch_profiler_chrome_traces(tmp_path) -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 20, "dur": 1, "args": {"stream": 9}},
    ]}
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(trace, f)
    events = gpu_events(load_trace(path))
    assert [(e.name, e.stream) for e in events] == [("k", 7), ("Memset", 9)]


def test_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="steps=0"):
        summarize([], steps=0)


def test_a_step_splits_into_host_lead_in_gpu_window_and_host_after() -> None:
    # Step 1 (host range [0, 100)): the GPU starts at 30 and runs until 170, past the host's range (the host ran
    # ahead; the synchronization after the step waits): 30 lead-in, 140 window with 10 idle (140, 150), 0 after.
    # Step 2 ([200, 300)): the GPU runs [210, 250) and the host works on to 300: 10 lead-in, 40 window, 50
    # after. One blocking call of 5 us in step 2's range; the one at 150 lies outside the host's ranges.
    events = [_ev("gemm", 7, 30, 60), _ev("nccl", 20, 80, 60), _ev("k2", 7, 150, 20), _ev("adam", 7, 210, 40)]
    b = step_breakdown(events, [(0, 100), (200, 300)], [(150, 160), (260, 265)])
    assert b is not None and b.steps == 2
    assert b.step_ms == pytest.approx((170 + 100) / 2 * 1e-3)
    assert b.lead_in_ms == pytest.approx((30 + 10) / 2 * 1e-3)
    assert b.window_ms == pytest.approx((140 + 40) / 2 * 1e-3)
    assert b.host_after_ms == pytest.approx((0 + 50) / 2 * 1e-3)
    assert b.step_ms == pytest.approx(b.lead_in_ms + b.window_ms + b.host_after_ms)
    assert b.idle_ms == pytest.approx(10 / 2 * 1e-3)
    assert b.gaps == [(pytest.approx(0.01), pytest.approx(0.14), "k2")]
    assert (b.syncs_per_step, b.sync_ms) == (0.5, pytest.approx(2.5e-3))
    assert step_breakdown(events, []) is None


def test_a_step_without_gpu_work_is_all_host_time() -> None:
    b = step_breakdown([], [(0, 50)])
    assert b is not None and (b.step_ms, b.lead_in_ms, b.window_ms, b.host_after_ms) == (
        pytest.approx(0.05), pytest.approx(0.05), 0, 0)


def test_reads_step_marks_and_blocking_calls_from_a_trace() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 100, "dur": 60},
        {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 0, "dur": 40},
        {"ph": "X", "cat": "gpu_user_annotation", "name": STEP_MARK, "ts": 5, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 120, "dur": 3},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 121, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "cudaMemcpy", "ts": 7, "dur": 1},
    ]}
    # The GPU's own copy of a range is not the host's step; a kernel is no host call.
    assert step_marks(trace) == [(0.0, 40.0), (100.0, 160.0)]
    assert host_syncs(trace) == [(120.0, 123.0)]
    steps = step_breakdown([], step_marks(trace), host_syncs(trace))
    line = summary_lines("builtin-shard_grad_op-rank0", summarize([_ev("k", 7, 1, 1)], 2), steps)[1]
    assert line.startswith("  step 0.05 ms = host lead-in 0.05 + GPU window 0.00 + host after 0.00; 0.5 blocking")


def test_the_first_collective_of_each_step_and_a_cpu_trace_summary() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": STEP_MARK, "ts": 200, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 5, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "ts": 40, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_reduce_scatter_base_", "ts": 70, "dur": 10},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "ts": 41, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "ts": 220, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 150, "dur": 10},  # between the steps
    ]}
    assert host_collectives(trace) == [(40.0, 50.0), (70.0, 80.0), (150.0, 160.0), (220.0, 230.0)]
    steps = step_breakdown(gpu_events(trace), step_marks(trace), host_syncs(trace), collectives=host_collectives(trace))
    assert steps is not None and steps.first_collective_ms == pytest.approx((40 + 20) / 2 * 1e-3)
    # No GPU events (CPU ranks): the host's step and first collective only, no GPU numbers.
    lines = summary_lines("gpt-builtin-shard_grad_op-rank0", summarize(gpu_events(trace), 2), steps)
    assert lines == ["gpt-builtin-shard_grad_op-rank0: no GPU work; host step 0.10 ms",
                     "  first collective issued 0.030 ms after the step's start"]
    assert step_breakdown([], [(0, 10)]).first_collective_ms is None  # type: ignore[union-attr]
