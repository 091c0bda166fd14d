"""``harness.conformance.seeds.fsdp_wrap``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
"""

from __future__ import annotations

from harness.conformance.seeds.fsdp_wrap import (
    api,
    test_error_already_wrapped,
    test_frozen_params,
    test_wrap_batchnorm_individually,
    test_bn_always_wrapped_individually,
    test_wrap,
    test_wrap_disabled_outside_context,
    test_wrap_override_defaults,
    test_always_wrap,
    test_transformer_wrapping,
    test_custom_policy,
    test_auto_wrap_api,
    test_auto_wrap_preset_exclude_wrap,
    test_auto_wrap_preset_exclude_wrap_include_children,
    test_auto_wrap_preset_force_leaf,
    test_auto_wrap_preset_force_leaf_custom,
    test_auto_wrap_with_ignored_modules,
    test_main_wrap_api_settings,
)

__all__ = [
    "api",
    "test_error_already_wrapped",
    "test_frozen_params",
    "test_wrap_batchnorm_individually",
    "test_bn_always_wrapped_individually",
    "test_wrap",
    "test_wrap_disabled_outside_context",
    "test_wrap_override_defaults",
    "test_always_wrap",
    "test_transformer_wrapping",
    "test_custom_policy",
    "test_auto_wrap_api",
    "test_auto_wrap_preset_exclude_wrap",
    "test_auto_wrap_preset_exclude_wrap_include_children",
    "test_auto_wrap_preset_force_leaf",
    "test_auto_wrap_preset_force_leaf_custom",
    "test_auto_wrap_with_ignored_modules",
    "test_main_wrap_api_settings",
]
