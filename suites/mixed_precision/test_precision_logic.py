"""``harness.conformance.mixed_precision.precision_logic``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
The rank pools are the folder's (``conftest.py``): one for every module.
"""

from __future__ import annotations

from harness.conformance.mixed_precision.precision_logic import (
    test_cast_floating_tensors_leaves_integers_and_others,
    test_cast_floating_tensors_none_is_identity,
    test_buffer_precision_innermost_owner_wins_and_round_trips,
    test_handle_full_precision_switch,
    test_handle_full_precision_refuses_while_unsharded,
    test_handle_reduce_only_switches_reduce_dtype_not_leaf,
    test_handle_without_mixed_precision_never_forces,
    test_precision_spec_resolves_fsdp1_rules,
    test_full_precision_emulation_is_plain_data_parallel_training,
    test_emulation_keeps_master_and_optimizer_in_full_precision,
    test_every_cast_of_parity_net_moves_the_numbers,
)

__all__ = [
    "test_cast_floating_tensors_leaves_integers_and_others",
    "test_cast_floating_tensors_none_is_identity",
    "test_buffer_precision_innermost_owner_wins_and_round_trips",
    "test_handle_full_precision_switch",
    "test_handle_full_precision_refuses_while_unsharded",
    "test_handle_reduce_only_switches_reduce_dtype_not_leaf",
    "test_handle_without_mixed_precision_never_forces",
    "test_precision_spec_resolves_fsdp1_rules",
    "test_full_precision_emulation_is_plain_data_parallel_training",
    "test_emulation_keeps_master_and_optimizer_in_full_precision",
    "test_every_cast_of_parity_net_moves_the_numbers",
]
