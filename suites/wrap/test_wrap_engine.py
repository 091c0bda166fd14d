"""``harness.conformance.wrap.wrap_engine``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.wrap.wrap_engine import (
    api,
    cpu_pair,
    cpu_single,
    gpu_pair,
    gpu_single,
    test_main_wrap_api,
    test_auto_wrap_smoke_test,
    test_mixed_precision_batchnorm_unit_runs_in_float32,
)

__all__ = [
    "api",
    "cpu_pair",
    "cpu_single",
    "gpu_pair",
    "gpu_single",
    "test_main_wrap_api",
    "test_auto_wrap_smoke_test",
    "test_mixed_precision_batchnorm_unit_runs_in_float32",
]
