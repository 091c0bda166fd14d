"""``harness.conformance.seeds.fsdp_differences``, collected into the CI tier (written once, in the package: see
``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds import fsdp_differences
from harness.conformance.seeds.fsdp_differences import (
    api,
    test_cpu_module_without_device_id,
    test_cpu_offload_without_accelerator,
)

__all__ = ["api", "test_cpu_module_without_device_id", "test_cpu_offload_without_accelerator"]

pytestmark = fsdp_differences.pytestmark
