"""What a torch profiler Chrome trace of training steps says about the GPU, in a few numbers.

``harness perf --profile DIR`` writes one trace per engine, strategy and rank; reading them side by
side in a viewer is slow, and the questions asked of them are always the same: how long the GPU
was busy per step, which streams ran what, whether communication overlapped compute or waited for
it, and which kernels took the time. Plain functions over the trace's events (no torch import):
:func:`summarize` turns a trace into a :class:`TraceSummary`, :func:`summary_lines` into text.

Steps: the profiled steps run as the timed ones do (the device synchronized before and after each) inside
a profiler range named :data:`STEP_MARK`; :func:`step_breakdown` splits each step's wall time into the
host's lead-in before the GPU's first event, the GPU window, and the host's work after the GPU's last
event, and counts the host's blocking CUDA calls inside the step. A step time that two engines' GPU
windows do not explain is in those numbers.

Streams: the one with the most kernel time is the compute stream; every other stream is a side
stream (all-gathers, reductions, copies). Communication kernels are NCCL's (``nccl`` in the name)
and copies on side streams. Overlap is measured on the union of intervals: the time a side stream
was busy while the compute stream was busy too.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "GpuEvent", "StepBreakdown", "StreamSummary", "TraceSummary", "gpu_events", "host_collectives", "host_syncs",
    "load_trace",
    "step_breakdown", "step_marks", "summarize", "summary_lines",
]

#: Chrome-trace categories of work the GPU does.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = tuple[float, float]

#: the profiler range around each profiled step (``harness.perf.benchmark`` opens it).
STEP_MARK = "harness.perf.step"
#: CUDA runtime calls that block the host until the device (or a stream or event of it) catches up.
BLOCKING_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclass(frozen=True)
class GpuEvent:
    """One kernel, copy or memset: where it ran and when (microseconds)."""

    name: str
    category: str
    stream: int
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us

    @property
    def is_comm(self) -> bool:
        return "nccl" in self.name.lower()


@dataclass
class StreamSummary:
    stream: int
    busy_ms: float
    events: int
    #: busy time that coincides with compute-stream busy time (0 for the compute stream itself).
    overlapped_ms: float
    top_kernel: str


@dataclass
class TraceSummary:
    steps: int
    #: first GPU event start to last end, per step.
    window_ms_per_step: float
    #: time no stream ran anything, per step.
    idle_ms_per_step: float
    compute_stream: int | None
    streams: list[StreamSummary] = field(default_factory=list)
    #: NCCL kernel time per step and the part of it overlapped by compute-stream work.
    comm_ms_per_step: float = 0.0
    comm_overlapped_ms_per_step: float = 0.0
    #: ``(name, count per step, ms per step)``, largest first.
    top_kernels: list[tuple[str, float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StepBreakdown:
    """Where the wall time of the marked steps went, per step in milliseconds.

    ``step_ms`` = ``lead_in_ms`` + ``window_ms`` + ``host_after_ms``: the host's time from the step's start to
    the GPU's first event of it, the GPU's first to last event, and the host's time after the GPU's last
    event (the step's Python still running while the GPU has nothing left)."""

    steps: int
    step_ms: float
    lead_in_ms: float
    window_ms: float
    host_after_ms: float
    #: time inside the GPU window that no stream ran anything.
    idle_ms: float
    #: blocking CUDA calls of the host inside a step (:data:`BLOCKING_CALLS`), and the time they blocked.
    syncs_per_step: float
    sync_ms: float
    #: the longest idle gaps inside the windows, over all steps: ``(ms, ms from the step's start, the event
    #: after the gap)``, longest first.
    gaps: list[tuple[float, float, str]] = field(default_factory=list)
    #: the host's time from the step's start to its first collective call (``c10d::``; None: none in the step):
    #: what holds back the first all-gather, on CPU ranks as on GPUs.
    first_collective_ms: float | None = None


def load_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace as written by ``torch.profiler`` (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def gpu_events(trace: dict[str, Any]) -> list[GpuEvent]:
    """The GPU's complete events of a trace, in start order."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        args = e.get("args") or {}
        stream = args.get("stream", e.get("tid"))
        try:
            stream = int(stream)
        except (TypeError, ValueError):
            stream = -1
        events.append(GpuEvent(str(e.get("name", "")), e["cat"], stream, float(e["ts"]), float(e.get("dur", 0.0))))
    return sorted(events, key=lambda ev: ev.start_us)


def _host_ranges(trace: dict[str, Any], categories: tuple[str, ...], keep: Callable[[str], bool]) -> list[Interval]:
    """The intervals of the host's complete events of ``categories`` whose name ``keep`` accepts, in order."""
    ranges = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in categories and keep(str(e.get("name", ""))):
            ranges.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return sorted(ranges)


def step_marks(trace: dict[str, Any]) -> list[Interval]:
    """The host's intervals of the :data:`STEP_MARK` ranges, in order (empty for a trace without them);
    the GPU's copies of the ranges (``gpu_user_annotation``) are not the host's."""
    return _host_ranges(trace, ("user_annotation",), lambda name: name == STEP_MARK)


def host_collectives(trace: dict[str, Any]) -> list[Interval]:
    """The host's collective calls (``c10d::`` operators: all-gathers, reduce-scatters, all-reduces), in order."""
    return _host_ranges(trace, ("cpu_op",), lambda name: name.startswith("c10d::"))


def host_syncs(trace: dict[str, Any]) -> list[Interval]:
    """The host's blocking CUDA calls (:data:`BLOCKING_CALLS`), in order."""
    return _host_ranges(trace, ("cuda_runtime", "cuda_driver"), lambda name: name in BLOCKING_CALLS)


def step_breakdown(events: Sequence[GpuEvent], marks: Sequence[Interval], syncs: Sequence[Interval] = (),
                   collectives: Sequence[Interval] = (), top_gaps: int = 5) -> StepBreakdown | None:
    """Lead-in, GPU window and host time after it for the steps ``marks`` delimit (None without marks).

    A step's GPU events are those that start after its mark starts and before the next mark starts (the
    host runs ahead of the GPU, so most of them start after the mark ends); a step ends when both its
    host range and its last GPU event have ended (the synchronization after it waits for both)."""
    if not marks:
        return None
    totals = [0.0] * 7
    gaps: list[tuple[float, float, str]] = []
    firsts: list[float] = []
    bounds = [m[0] for m in marks[1:]] + [float("inf")]
    for (start, end), stop in zip(marks, bounds):
        mine = [e for e in events if start <= e.start_us < stop]
        first = min((e.start_us for e in mine), default=end)
        last = max((e.end_us for e in mine), default=end)
        busy = _union((e.start_us, e.end_us) for e in mine)
        for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
            after = next(e.name for e in mine if e.start_us >= gap_end)
            gaps.append(((gap_end - gap_start) * 1e-3, (gap_start - start) * 1e-3, after))
        blocked = [(a, b) for a, b in syncs if start <= a < end]
        first_call = next((a for a, _ in collectives if start <= a < end), None)
        if first_call is not None:
            firsts.append(first_call - start)
        window = max(last - first, 0.0)
        parts = (max(end, last) - start, first - start, window, max(end - last, 0.0), window - _length(busy),
                 float(len(blocked)), _length(blocked))
        totals = [t + p for t, p in zip(totals, parts)]
    n = len(marks)
    step, lead, window, after, idle, count, blocked_us = (t / n for t in totals)
    return StepBreakdown(n, step * 1e-3, lead * 1e-3, window * 1e-3, after * 1e-3, idle * 1e-3, count,
                         blocked_us * 1e-3, sorted(gaps, reverse=True)[:top_gaps],
                         sum(firsts) / len(firsts) * 1e-3 if firsts else None)


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: Sequence[GpuEvent], steps: int, top: int = 8) -> TraceSummary:
    """The numbers of a trace of ``steps`` training steps (per step, in milliseconds)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1 (the number of profiled steps in the trace)")
    if not events:
        return TraceSummary(steps, 0.0, 0.0, None)
    per_step = 1e-3 / steps
    by_stream: dict[int, list[GpuEvent]] = defaultdict(list)
    for ev in events:
        by_stream[ev.stream].append(ev)
    unions = {s: _union((e.start_us, e.end_us) for e in evs) for s, evs in by_stream.items()}
    compute = max(unions, key=lambda s: _length(unions[s]))
    streams = []
    for s, evs in sorted(by_stream.items(), key=lambda kv: -_length(unions[kv[0]])):
        time_by_name: dict[str, float] = defaultdict(float)
        for e in evs:
            time_by_name[e.name] += e.dur_us
        overlapped = 0.0 if s == compute else _intersection(unions[s], unions[compute])
        streams.append(StreamSummary(s, _length(unions[s]) * per_step, len(evs), overlapped * per_step,
                                     max(time_by_name, key=time_by_name.__getitem__)))
    window = max(e.end_us for e in events) - events[0].start_us
    busy = _length(_union((e.start_us, e.end_us) for e in events))
    comm = _union((e.start_us, e.end_us) for e in events if e.is_comm)
    counts: dict[str, int] = defaultdict(int)
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        counts[e.name] += 1
        totals[e.name] += e.dur_us
    ranked = sorted(totals, key=totals.__getitem__, reverse=True)[:top]
    return TraceSummary(
        steps=steps,
        window_ms_per_step=window * per_step,
        idle_ms_per_step=(window - busy) * per_step,
        compute_stream=compute,
        streams=streams,
        comm_ms_per_step=_length(comm) * per_step,
        comm_overlapped_ms_per_step=_intersection(comm, unions[compute]) * per_step,
        top_kernels=[(name, counts[name] / steps, totals[name] * per_step) for name in ranked],
    )


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def summary_lines(label: str, summary: TraceSummary, steps: StepBreakdown | None = None) -> list[str]:
    """A few lines per trace for the perf report (a trace of CPU ranks: the host's step and first collective)."""
    s = summary
    first = (f"  first collective issued {steps.first_collective_ms:.3f} ms after the step's start"
             if steps is not None and steps.first_collective_ms is not None else None)
    if s.compute_stream is None:
        head = f"{label}: no GPU work" + ("" if steps is None else f"; host step {steps.step_ms:.2f} ms")
        return [head] + ([first] if first else [])
    lines = [f"{label}: GPU window {s.window_ms_per_step:.2f} ms/step, idle {s.idle_ms_per_step:.2f} ms/step"]
    if first:
        lines.append(first)
    if steps is not None:
        lines.append(f"  step {steps.step_ms:.2f} ms = host lead-in {steps.lead_in_ms:.2f} + GPU window "
                     f"{steps.window_ms:.2f} + host after {steps.host_after_ms:.2f}; {steps.syncs_per_step:g} "
                     f"blocking CUDA calls a step ({steps.sync_ms:.2f} ms)")
        lines.append(f"  GPU idle inside the window {steps.idle_ms:.2f} ms/step; longest gaps: "
                     + ", ".join(f"{ms:.2f} ms at +{at:.1f} ms before {_short(name, 40)}" for ms, at, name in steps.gaps))
    if s.comm_ms_per_step:
        lines.append(f"  NCCL {s.comm_ms_per_step:.2f} ms/step, {s.comm_overlapped_ms_per_step:.2f} ms of it under compute")
    for st in s.streams:
        role = "compute" if st.stream == s.compute_stream else f"side, {st.overlapped_ms:.2f} ms under compute"
        lines.append(f"  stream {st.stream} ({role}): busy {st.busy_ms:.2f} ms/step, {st.events} events; most time: {_short(st.top_kernel)}")
    for name, count, ms in s.top_kernels:
        lines.append(f"    {ms:8.2f} ms/step  x{count:g}  {_short(name)}")
    return lines
