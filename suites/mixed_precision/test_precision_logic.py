"""``harness.conformance.mixed_precision.precision_logic``, collected into the CI tier (written once, in the package: see
``harness.conformance``).
The rank pools are the folder's (``conftest.py``): one for every module.
"""

from __future__ import annotations

from harness.conformance.mixed_precision.precision_logic import *  # noqa: F403 (its __all__: the fixtures and tests, in the order they run)
