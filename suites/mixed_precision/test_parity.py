"""``harness.conformance.mixed_precision.parity``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
The rank pools are the folder's (``conftest.py``): one for every module.
"""

from __future__ import annotations

from harness.conformance.mixed_precision.parity import test_parity_with_emulating_reference

__all__ = ["test_parity_with_emulating_reference"]
