"""``harness.conformance.seeds.fsdp_clip_grad_norm``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.fsdp_clip_grad_norm import session, test_check

__all__ = ["session", "test_check"]
