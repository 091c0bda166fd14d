"""``harness.conformance.mixed_precision.gpu``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
The rank pools are the folder's (``conftest.py``): one for every module.
"""

from __future__ import annotations

from harness.conformance.mixed_precision import gpu
from harness.conformance.mixed_precision.gpu import (
    test_e2e_full_shard,
    test_e2e_no_reshard_after_forward,
    test_e2e_unsharded,
    test_mp_batchnorm,
    test_mixed_precision_resnet,
    test_mp_embedding,
    test_job,
    test_sharded_grad_scaler,
    test_parity_with_emulating_reference,
)

__all__ = [
    "test_e2e_full_shard",
    "test_e2e_no_reshard_after_forward",
    "test_e2e_unsharded",
    "test_mp_batchnorm",
    "test_mixed_precision_resnet",
    "test_mp_embedding",
    "test_job",
    "test_sharded_grad_scaler",
    "test_parity_with_emulating_reference",
]

pytestmark = gpu.pytestmark
