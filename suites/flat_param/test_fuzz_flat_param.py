"""The flat-parameter fuzz properties, collected into the CI lane.

They are written once, in ``harness.conformance.flat_param_properties``, so that the nightly's campaign
(``python -m harness.conformance.fuzz_campaign``) runs them from an installed package; importing them
here makes pytest collect them with this suite, under the profile of ``--hypothesis-profile`` or
``FUZZ_PROFILE`` (``ci`` by default: 300 derandomized examples per property; root conftest.py).
"""

from __future__ import annotations

import pytest

from harness.conformance import flat_param_properties
from harness.conformance.flat_param_properties import (
    test_aligned_mode_starts_are_aligned,
    test_every_element_owned_once_at_oracle_offset,
    test_metadata_and_shard_match_torch_fsdp1,
    test_numels_and_bytes_preserved,
    test_shard_concat_unflatten_roundtrip_bitwise,
    test_shards_equal_size_and_padding_bounded,
)

__all__ = [
    "test_aligned_mode_starts_are_aligned",
    "test_every_element_owned_once_at_oracle_offset",
    "test_metadata_and_shard_match_torch_fsdp1",
    "test_numels_and_bytes_preserved",
    "test_shard_concat_unflatten_roundtrip_bitwise",
    "test_shards_equal_size_and_padding_bounded",
]

pytestmark = [pytest.mark.fuzz, *flat_param_properties.pytestmark]


def test_every_property_is_collected_here() -> None:
    """A property added to the package must be imported above, or the CI lane would never run it."""
    written = {name for name in vars(flat_param_properties) if name.startswith("test_")}
    assert written == set(__all__) == set(flat_param_properties.__all__) - {"pytestmark"}
