"""The flat-parameter fuzz properties, collected into the CI tier.

They are written once, in ``harness.conformance.flat_param_properties``, so that the nightly's campaign
(``python -m harness.conformance.fuzz_campaign``) runs them from an installed package; importing them
here makes pytest collect them with this suite, under the profile of ``--hypothesis-profile`` or
``FUZZ_PROFILE`` (``ci`` by default: 300 derandomized examples per property; root conftest.py).
"""

from __future__ import annotations

import pytest

from harness.conformance import flat_param_properties
from harness.conformance.flat_param_properties import *  # noqa: F403 (its __all__: the fixtures and tests, in the order they run)


pytestmark = [pytest.mark.fuzz, *flat_param_properties.pytestmark]


def test_every_property_is_collected_here() -> None:
    """A property added to the package must be in its ``__all__`` (what the star import above brings),
    or the CI tier would never run it."""
    written = {name for name in vars(flat_param_properties) if name.startswith("test_")}
    collected = {name for name in globals() if name.startswith("test_")} - {"test_every_property_is_collected_here"}
    assert written == collected and written <= set(flat_param_properties.__all__)
