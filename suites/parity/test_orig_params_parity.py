"""Generated parity cases: use_orig_params against flat parameters with frozen parameters (LoRA) and a tied LM head (GPT).

Each case trains the engine and the reference side by side (harness.compare.parity) on the shared rank pool;
the slice is ``suites.parity.slices.ORIG_PARAMS``, walked by the generator ``--matrix`` chooses, for every
``--engine`` x ``--reference`` x ``--world-size``. An engine that cannot express a case skips it
with its reason.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from suites.parity.slices import ORIG_PARAMS


@pytest.mark.parity_matrix(ORIG_PARAMS)
def test_orig_params_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)
