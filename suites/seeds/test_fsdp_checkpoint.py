"""``harness.conformance.seeds.fsdp_checkpoint``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.fsdp_checkpoint import test_checkpoint_parity

__all__ = ["test_checkpoint_parity"]
