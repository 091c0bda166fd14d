"""How busy the host was while cases ran: its cores (``/proc/stat``) and each GPU the cases used (NVML, through
``torch.cuda.utilization``), sampled about once a second by ``HostSampler``, a thread the nightly runs around its
cases (``nightly.json``'s ``cases.host``).

``cores_busy`` is pure (two snapshots of ``/proc/stat`` in, busy cores out). Whatever cannot be measured here
(``/proc/stat`` off Linux, NVML without ``pynvml`` or a driver) reads ``not measured: <why>`` in the summary: the
first failure stops that kind of sample, so a missing library costs one exception, not one a second.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HostSampler", "cores_busy", "cpu_jiffies", "host_text"]

#: seconds between samples.
INTERVAL_S = 1.0


def cpu_jiffies(stat: str) -> tuple[int, int, int]:
    """``(idle, total, logical cores)`` of ``/proc/stat``'s text: the aggregate ``cpu`` line's idle and iowait
    jiffies, all its jiffies but guest time (already inside user and nice), and the ``cpuN`` lines."""
    lines = stat.splitlines()
    aggregate = next((line.split() for line in lines if line.startswith("cpu ")), None)
    if aggregate is None or len(aggregate) < 5:
        raise ValueError(f"cpu_jiffies: stat has no aggregate 'cpu' line; pass /proc/stat's text, not {stat[:40]!r}")
    fields = [int(v) for v in aggregate[1:]]
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8]), cores


def cores_busy(before: str, after: str) -> float:
    """Busy cores between two snapshots of ``/proc/stat``: ``(1 - idle share) x logical cores``; 0 when no time
    passed between them."""
    idle0, total0, _ = cpu_jiffies(before)
    idle1, total1, cores = cpu_jiffies(after)
    elapsed = total1 - total0
    if elapsed < 0:
        raise ValueError("cores_busy: after is older than before (its jiffies are fewer); pass the snapshots in order")
    return 0.0 if elapsed == 0 else (1.0 - (idle1 - idle0) / elapsed) * cores


def _read_proc_stat() -> str:
    return Path("/proc/stat").read_text(encoding="ascii")


def _gpu_busy_pct(index: int) -> float:
    import torch

    return float(torch.cuda.utilization(index))


class HostSampler:
    """A daemon thread sampling the cores and ``gpus`` (CUDA indices as the process sees them) every
    ``interval_s`` from ``start`` to ``stop``, which returns the summary (``summary``). ``read_stat`` and
    ``gpu_busy`` are the sources (``/proc/stat``, NVML), replaceable in tests."""

    def __init__(self, gpus: Sequence[int] = (), interval_s: float = INTERVAL_S,
                 read_stat: Callable[[], str] = _read_proc_stat, gpu_busy: Callable[[int], float] = _gpu_busy_pct) -> None:
        if interval_s <= 0:
            raise ValueError(f"HostSampler: interval_s={interval_s} must be > 0")
        self.gpus = list(gpus)
        self.interval_s = interval_s
        self._read_stat, self._gpu_busy = read_stat, gpu_busy
        self.cores: list[float] = []
        self.gpu_pct: dict[int, list[float]] = {i: [] for i in self.gpus}
        self.logical_cores: int | None = None
        #: why cores or GPUs are not measured (set at the first failure); None while they are.
        self.cores_problem: str | None = None if sys.platform.startswith("linux") else f"/proc/stat is Linux's, this is {sys.platform}"
        self.gpus_problem: str | None = None if self.gpus else "the cases ran on no GPU"
        self._last_stat: str | None = None
        self._last_t = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="harness-host-sampler")

    def start(self) -> "HostSampler":
        self._last_stat, self._last_t = self._stat(), time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling and return the summary; the time since the last sample is one more sample unless it is
        too short to read (``/proc/stat`` counts in hundredths of a second)."""
        self._stop.set()
        if self._thread.ident is not None:  # started: a start that failed leaves nothing to join
            self._thread.join(timeout=10 * self.interval_s)
        if time.monotonic() - self._last_t >= min(0.2, self.interval_s / 2):
            self._sample()
        return self.summary()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _stat(self) -> str | None:
        if self.cores_problem is not None:
            return None
        try:
            return self._read_stat()
        except Exception as exc:  # noqa: BLE001 - said once in the summary, never fatal to the run
            self.cores_problem = f"{type(exc).__name__}: {exc}"
            return None

    def _sample(self) -> None:
        stat, self._last_t = self._stat(), time.monotonic()
        if stat is not None and self._last_stat is not None:
            try:
                self.cores.append(cores_busy(self._last_stat, stat))
                self.logical_cores = cpu_jiffies(stat)[2]
            except ValueError as exc:
                self.cores_problem = str(exc)
        self._last_stat = stat
        if self.gpus_problem is None:
            try:
                busy = {i: self._gpu_busy(i) for i in self.gpus}
            except Exception as exc:  # noqa: BLE001 - pynvml missing, no driver, a GPU gone: said once
                self.gpus_problem = f"{type(exc).__name__}: {exc}"
            else:
                for i, pct in busy.items():
                    self.gpu_pct[i].append(pct)

    def summary(self) -> dict[str, Any]:
        """``{"interval_s", "samples", "cores": {"logical", "mean_busy", "max_busy"}, "gpus": {index: {"mean_pct",
        "max_pct"}}}``, where either of ``cores`` and ``gpus`` may be ``not measured: <why>``."""
        cores: Any = (f"not measured: {self.cores_problem}" if self.cores_problem is not None else
                      {"logical": self.logical_cores} | _stats(self.cores, "busy"))
        gpus: Any = (f"not measured: {self.gpus_problem}" if self.gpus_problem is not None else
                     {str(i): _stats(v, "pct") for i, v in self.gpu_pct.items()})
        return {"interval_s": self.interval_s, "samples": len(self.cores) or max(map(len, self.gpu_pct.values()), default=0),
                "cores": cores, "gpus": gpus}


def _stats(values: Sequence[float], unit: str) -> dict[str, float | None]:
    if not values:
        return {f"mean_{unit}": None, f"max_{unit}": None}
    return {f"mean_{unit}": round(sum(values) / len(values), 2), f"max_{unit}": round(max(values), 2)}


def host_text(host: Mapping[str, Any]) -> str:
    """``host: cores busy 1.62 mean, 2.00 max of 2; GPU 0 busy 41% mean, 97% max``: ``HostSampler.summary`` in a line."""
    cores, gpus = host.get("cores"), host.get("gpus")
    if isinstance(cores, Mapping) and cores.get("mean_busy") is not None:
        parts = [f"cores busy {cores['mean_busy']:.2f} mean, {cores['max_busy']:.2f} max of {cores['logical']}"]
    else:
        parts = [f"cores {cores if isinstance(cores, str) else 'not measured: no sample'}"]
    if isinstance(gpus, Mapping):
        parts += [f"GPU {i} busy {g['mean_pct']:.0f}% mean, {g['max_pct']:.0f}% max" if g.get("mean_pct") is not None
                  else f"GPU {i} not measured: no sample" for i, g in gpus.items()]
    else:
        parts.append(f"GPUs {gpus}")
    return f"host ({host.get('samples', 0)} samples): " + "; ".join(parts)
