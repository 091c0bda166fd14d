"""Generated parity cases: models with different wrap units: always-wrap, rank-local expert, LoRA, BatchNorm unit, tied GPT.

Each case trains the engine and the reference side by side (harness.compare.parity) on the shared rank pool;
the slice is ``suites.parity.slices.WRAP``, walked by the generator ``--matrix`` chooses, for every
``--engine`` x ``--reference`` x ``--world-size``. An engine that cannot express a case skips it
with its reason.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from suites.parity.slices import WRAP


@pytest.mark.parity_matrix(WRAP)
def test_wrap_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)
