"""``harness.conformance.seeds.seed_parity``, collected into the CI tier (written once, in the package: see
``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.seed_parity import *  # noqa: F403 (its __all__: the fixtures and tests, in the order they run)
