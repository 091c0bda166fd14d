"""``harness.conformance.seeds.fsdp_wrap``, collected into the CI tier (written once, in the package: see
``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.fsdp_wrap import *  # noqa: F403 (its __all__: the fixtures and tests, in the order they run)
