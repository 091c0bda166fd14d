"""Generated parity cases: every precision config x strategy, on BatchNorm (floating buffers) and the tied transformer.

Each case trains the engine and the reference side by side (harness.compare.parity) on the shared rank pool;
the slice is ``suites.parity.slices.MIXED_PRECISION``, walked by the generator ``--matrix`` chooses, for every
``--engine`` x ``--reference`` x ``--world-size``. An engine that cannot express a case skips it
with its reason.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from suites.parity.slices import MIXED_PRECISION


@pytest.mark.parity_matrix(MIXED_PRECISION)
def test_mixed_precision_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)
