"""Where our engine and torch FSDP1 differ by design, each engine's own behaviour (``api``), so that a
change on either side shows here rather than as a mysterious skip in the ported suites.

Both differences are about hosts without an accelerator, where the ported suites run in CI:

- torch FSDP1 refuses a CPU module without ``device_id`` ("FSDP needs a non-CPU accelerator device");
  our engine computes on CPU. The ported suites pass ``device_id=cpu`` to torch (``FSDPApi.wrap``).
- torch FSDP1's CPU offload pins host memory at its lazy init, which raises without an accelerator;
  our engine offloads to unpinned memory. The ported suites skip torch's offload checks there.

Units are built on a one-rank process-group double (no communication), as in ``fsdp_wrap``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness.conformance.flat_handles import DummyProcessGroup
from harness.conformance.fsdp1_checks import FSDPApi, api

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["api", "test_cpu_module_without_device_id", "test_cpu_offload_without_accelerator", "pytestmark"]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="both differences are about hosts without an accelerator; this one has CUDA"
)

PG = DummyProcessGroup(rank=0, size=1)


def test_cpu_module_without_device_id(api: FSDPApi) -> None:
    if api.is_torch:
        with pytest.raises(RuntimeError, match="FSDP needs a non-CPU accelerator device"):
            api.FSDP(nn.Linear(3, 3), process_group=PG)
    else:
        model = api.FSDP(nn.Linear(3, 3), process_group=PG)
        assert model(torch.randn(2, 3)).device.type == "cpu"


def test_cpu_offload_without_accelerator(api: FSDPApi) -> None:
    model = api.wrap(nn.Linear(3, 3), process_group=PG, cpu_offload=api.CPUOffload(offload_params=True))
    x = torch.randn(2, 3)
    if api.is_torch:
        # Construction succeeds; pinning the offloaded shard at the first forward's lazy init fails.
        with pytest.raises(RuntimeError, match="Cannot access accelerator device when none is available"):
            model(x)
    else:
        assert model(x).device.type == "cpu"
        assert all(p.device.type == "cpu" and not p.is_pinned() for p in model.parameters())
