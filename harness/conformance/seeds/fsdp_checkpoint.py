"""Behaviours of torch's test_fsdp_checkpoint.py, as conformance checks against every engine with
torch FSDP1's API (``fsdp_api``: our engine and torch FSDP1), as harness cases on the plugin's pool:
activation checkpointing (``checkpoint_wrapper``, reentrant and non-reentrant) inside the units
(``FSDP(checkpoint_wrapper(block))``) and around them (``checkpoint_wrapper(FSDP(block))``, the
``checkpoint_wrapper`` extra of ``harness.cases.case.FSDP1_EXTRAS``), so the recomputed forward runs the units'
forward hooks again inside backward. The innermost units (the nested model's linears) are checkpointed;
each trains against the unsharded local reference over FULL_SHARD and SHARD_GRAD_OP, with flat and
original parameters.

Units inside a non-reentrant checkpoint: the recomputation in backward runs the unit's forward after its
pre-backward unsharded it, and stops before the unit's post-forward; FSDP1 skips both hooks then.
"""

from __future__ import annotations

import itertools

import pytest

from harness.cases.case import CaseConfig
from harness.conformance.engine_models import NESTED
from harness.pytest_plugin import ParityRunner

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["test_checkpoint_parity"]

#: check name -> the checkpoint implementation and where its wrapper goes.
CHECKS = {
    "check_checkpoint_inside_units_reentrant": ("reentrant", "inside"),
    "check_checkpoint_inside_units_non_reentrant": ("non_reentrant", "inside"),
    "check_units_inside_checkpoint_reentrant": ("reentrant", "around"),
    "check_units_inside_checkpoint_non_reentrant": ("non_reentrant", "around"),
}
CASES = [
    pytest.param(
        check,
        CaseConfig(reference="local", model=NESTED, sharding_strategy=strategy, use_orig_params=orig,
                   activation_checkpointing=impl, extras=(("checkpoint_wrapper", where),) if where != "inside" else ()),
        id=f"{check}-{strategy}{'-orig' if orig else ''}",
    )
    for check, (impl, where) in CHECKS.items()
    for strategy, orig in itertools.product(["full_shard", "shard_grad_op"], [False, True])
]


@pytest.mark.parametrize(("check", "case"), CASES)
def test_checkpoint_parity(fsdp_api: str, check: str, case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(case.replace(engine=fsdp_api))
