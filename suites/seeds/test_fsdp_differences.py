"""``harness.conformance.seeds.fsdp_differences``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
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
