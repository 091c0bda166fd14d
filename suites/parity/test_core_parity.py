"""Generated parity cases: strategy x backward prefetch x CPU offload x use_orig_params on the core models (nested units, tied transformer).

Each case trains the engine and the reference side by side (harness.compare.parity) on the shared rank pool;
the slice is ``suites.parity.slices.CORE``, walked by the generator ``--matrix`` chooses, for every
``--engine`` x ``--reference`` x ``--world-size``. An engine that cannot express a case skips it
with its reason.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from suites.parity.slices import CORE


@pytest.mark.parity_matrix(CORE)
def test_core_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)
