"""How busy the host was (``harness.run.host_load``): busy cores from two ``/proc/stat`` snapshots, and the
sampler's summary where a source works, fails once, or is not there."""

from __future__ import annotations

import itertools
import time

import pytest

from harness.run.host_load import HostSampler, cores_busy, cpu_jiffies, host_text

#: user nice system idle iowait irq softirq steal guest guest_nice, for 4 logical cores.
BEFORE = """cpu  1000 0 500 8000 500 0 0 0 200 0
cpu0 250 0 125 2000 125 0 0 0 50 0
cpu1 250 0 125 2000 125 0 0 0 50 0
cpu2 250 0 125 2000 125 0 0 0 50 0
cpu3 250 0 125 2000 125 0 0 0 50 0
intr 12345
ctxt 678
"""
#: 400 jiffies later: 250 busy (user, system, irq), 150 idle or iowait; guest time counted in user already.
AFTER = """cpu  1200 0 540 8140 510 0 10 0 300 0
cpu0 300 0 135 2035 128 0 3 0 75 0
cpu1 300 0 135 2035 127 0 3 0 75 0
cpu2 300 0 135 2035 128 0 2 0 75 0
cpu3 300 0 135 2035 127 0 2 0 75 0
intr 12399
"""


def test_busy_cores_from_two_snapshots() -> None:
    assert cpu_jiffies(BEFORE) == (8500, 10000, 4)
    assert cores_busy(BEFORE, AFTER) == pytest.approx((1 - 150 / 400) * 4)
    assert cores_busy(BEFORE, BEFORE) == 0.0
    with pytest.raises(ValueError, match="after is older"):
        cores_busy(AFTER, BEFORE)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        cpu_jiffies("intr 1\n")


def test_the_sampler_summarises_cores_and_gpus_and_says_what_it_could_not_measure() -> None:
    ticks = itertools.count(1)

    def stat() -> str:  # every snapshot 400 jiffies on, 100 of them idle: 3 of the 4 cores busy
        n = next(ticks)
        return f"cpu  {300 * n} 0 0 {100 * n} 0 0 0 0 0 0\n" + "".join(f"cpu{i} 0 0 0 0\n" for i in range(4))

    sampler = HostSampler(gpus=[0, 1], interval_s=0.01, read_stat=stat,
                          gpu_busy=lambda i: 40.0 + 20 * i).start()
    time.sleep(0.08)
    host = sampler.stop()
    assert host["samples"] >= 2 and host["cores"] == {"logical": 4, "mean_busy": 3.0, "max_busy": 3.0}
    assert host["gpus"] == {"0": {"mean_pct": 40.0, "max_pct": 40.0}, "1": {"mean_pct": 60.0, "max_pct": 60.0}}
    assert "GPU 1 busy 60% mean" in host_text(host)

    calls = []

    def no_nvml(index: int) -> float:
        calls.append(index)
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    def no_proc() -> str:
        raise FileNotFoundError("/proc/stat")

    host = HostSampler(gpus=[0], interval_s=0.01, read_stat=no_proc, gpu_busy=no_nvml).start()
    time.sleep(0.05)
    host = host.stop()
    assert calls == [0], "a source that failed is not asked again"
    assert host["gpus"] == "not measured: ModuleNotFoundError: nvidia-ml-py does not seem to be installed"
    assert host["cores"].startswith("not measured:")  # FileNotFoundError here, or not Linux
    assert HostSampler().summary()["gpus"] == "not measured: the cases ran on no GPU"
    assert "not measured" in host_text(host)
    with pytest.raises(ValueError, match="interval_s=0"):
        HostSampler(interval_s=0)
