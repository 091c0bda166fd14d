"""``harness.conformance.mixed_precision.grad_scaler``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
The rank pools are the folder's (``conftest.py``): one for every module.
"""

from __future__ import annotations

from harness.conformance.mixed_precision.grad_scaler import (
    test_all_ranks_skip_together,
    test_plain_grad_scaler_disagrees,
    test_scale_keeps_dtype,
    test_disabled_scaler_is_identity,
    test_scale_rejects_non_tensors,
)

__all__ = [
    "test_all_ranks_skip_together",
    "test_plain_grad_scaler_disagrees",
    "test_scale_keeps_dtype",
    "test_disabled_scaler_is_identity",
    "test_scale_rejects_non_tensors",
]
