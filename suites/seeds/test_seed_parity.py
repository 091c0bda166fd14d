"""``harness.conformance.seeds.seed_parity``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.seed_parity import (
    test_seed_parity,
    test_the_smoke_subtests_show_every_value_of_every_axis,
    test_no_sync_parity,
)

__all__ = ["test_seed_parity", "test_the_smoke_subtests_show_every_value_of_every_axis", "test_no_sync_parity"]
