"""``harness.conformance.seeds.foreach``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.foreach import test_foreach_kernels_take_empty_tensors

__all__ = ["test_foreach_kernels_take_empty_tensors"]
