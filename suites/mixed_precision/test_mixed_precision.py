"""``harness.conformance.mixed_precision.mixed_precision``, collected into the CI lane.

Written once, in the package, so that ``python -m harness certify`` runs it (its ``seeds`` family)
from an installed package; importing its tests and their fixtures here, in the order they run, makes
pytest collect them with this suite under the node ids they always had (``harness.conformance``).
The rank pools are the folder's (``conftest.py``): one for every module.
"""

from __future__ import annotations

from harness.conformance.mixed_precision.mixed_precision import (
    test_mixed_precision_e2e_full_shard,
    test_mixed_precision_no_reshard_after_forward,
    test_mixed_precision_unsharded,
    test_grads_reduced_precision,
    test_mp_embedding,
    test_mp_batchnorm,
    test_full_prec_in_eval_variable_is_fsdp1s,
    test_eval_root_cast_inputs,
    test_full_precision_in_eval,
    test_full_precision_in_eval_buffers,
    test_full_precision_in_eval_comm,
    test_input_grads_with_param_mixed_precision,
    test_no_sync_mixed_precision,
    test_mixed_precision_with_ignored_module,
    test_submodules_with_different_precisions,
    test_submodules_with_external_inputs,
    test_train_ema_eval_flow,
)

__all__ = [
    "test_mixed_precision_e2e_full_shard",
    "test_mixed_precision_no_reshard_after_forward",
    "test_mixed_precision_unsharded",
    "test_grads_reduced_precision",
    "test_mp_embedding",
    "test_mp_batchnorm",
    "test_full_prec_in_eval_variable_is_fsdp1s",
    "test_eval_root_cast_inputs",
    "test_full_precision_in_eval",
    "test_full_precision_in_eval_buffers",
    "test_full_precision_in_eval_comm",
    "test_input_grads_with_param_mixed_precision",
    "test_no_sync_mixed_precision",
    "test_mixed_precision_with_ignored_module",
    "test_submodules_with_different_precisions",
    "test_submodules_with_external_inputs",
    "test_train_ema_eval_flow",
]
