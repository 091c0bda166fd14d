"""The trace summary of ``harness perf --profile``: busy time, overlap and idle from known events."""

from __future__ import annotations

import gzip
import json

import pytest

from harness.perf.profile_summary import GpuEvent, gpu_events, load_trace, summarize, summary_lines


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
