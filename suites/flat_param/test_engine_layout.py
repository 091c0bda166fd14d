"""The flat-parameter layout check of every selected FSDP1-API engine against torch FSDP1, collected into
the CI tier.

Written once, in ``harness.conformance.engine_layout``, so that ``python -m harness certify`` runs it
(its ``flat-param`` family) from an installed package; importing the test and its fixture here makes
pytest collect them with this suite, once per engine ``--engine`` selects.
"""

from __future__ import annotations

from harness.conformance import engine_layout
from harness.conformance.engine_layout import *  # noqa: F403 (its __all__: the fixtures and tests, in the order they run)


pytestmark = engine_layout.pytestmark
