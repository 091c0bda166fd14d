"""Generated parity cases of torch's test_nested_wrapped_model_single_iteration_mixed_precision: one
float16 step of the nested units over strategy x CPU offload x use_orig_params, against the reference
emulating the casts (``suites.parity.slices.FP16_SINGLE_ITERATION``), for every ``--engine`` x
``--reference`` x ``--world-size``; the smoke tier (CI) shows every strategy with and without offload.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from suites.parity.slices import FP16_SINGLE_ITERATION


@pytest.mark.parity_matrix(FP16_SINGLE_ITERATION)
def test_fp16_single_iteration_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)
