"""The flat-parameter layout check of every selected FSDP1-API engine against torch FSDP1, collected into
the CI lane.

Written once, in ``harness.conformance.engine_layout``, so that ``python -m harness certify`` runs it
(its ``flat-param`` family) from an installed package; importing the test and its fixture here makes
pytest collect them with this suite, once per engine ``--engine`` selects.
"""

from __future__ import annotations

from harness.conformance import engine_layout
from harness.conformance.engine_layout import handle_api, test_layout_matches_torch_fsdp1

__all__ = ["handle_api", "test_layout_matches_torch_fsdp1"]

pytestmark = engine_layout.pytestmark
