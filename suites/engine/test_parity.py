"""Training parity of the builtin engine, as harness cases (``harness.compare.parity`` on the plugin's rank pools):
``suites.parity.slices.ENGINE_SWEEP``, every strategy x use_orig_params x backward prefetch x forward
prefetch x CPU offload (hybrid strategies aside: ``test_hybrid.py``) on the engine suites' nested,
tied-transformer and mixture-of-experts models (``harness.conformance.engine_models``), against DDP and the all-data
local reference.

The smoke tier (CI) shows every model with every value of every axis against both references; the
full tier (``--matrix full``) runs the whole product, on the GPUs where the host has them. The mixture
of experts is compared with its declared reduction: its experts are units over one-rank groups, which
DDP leaves out of its all-reduce and the local reference keeps per rank.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from harness.pytest_plugin.cases import ParityOptions
from suites.parity.slices import ENGINE_SWEEP

SWEEP_AXES = ("sharding_strategy", "use_orig_params", "backward_prefetch", "forward_prefetch", "cpu_offload")


@pytest.mark.parity_matrix(ENGINE_SWEEP)
def test_engine_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)


def test_smoke_shows_every_model_and_axis_value_against_both_references() -> None:
    cases = ENGINE_SWEEP.cases(ParityOptions(engines=("torch-fsdp",)))
    assert {c.engine for c in cases} == {"builtin"}, "the engine suites test the builtin engine whatever --engine says"
    seen = {(axis, getattr(c, axis), c.model, c.reference) for c in cases for axis in SWEEP_AXES}
    for model in ENGINE_SWEEP.axes["model"]:
        for axis in SWEEP_AXES:
            for value in ENGINE_SWEEP.axes[axis]:
                for reference in ("ddp", "local"):
                    assert (axis, value, model, reference) in seen, f"{model} {axis}={value} misses {reference}"
    assert len(cases) <= 30, f"the smoke tier stays small: {len(cases)} cases"


def test_the_full_tier_is_the_whole_product() -> None:
    cases = ENGINE_SWEEP.cases(ParityOptions(matrix="full", references=("ddp",)))
    assert sorted(ENGINE_SWEEP.axes) == sorted(("model", *SWEEP_AXES))
    assert len(cases) == 3 * 2 * 3 * 2 * 2 * len(ENGINE_SWEEP.axes["model"]), len(cases)
