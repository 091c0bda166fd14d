"""Generated parity cases of the training loop: parameter groups and two optimizers, gradient clipping,
accumulation with and without no_sync, activation checkpointing and compile (``harness.selection.matrix.LOOP_SLICE``).

The slice is ``suites.parity.slices.TRAINING_LOOP``, walked by the generator ``--matrix`` chooses, for every
``--engine`` x ``--reference`` x ``--world-size``; what an engine cannot express is left out by its
capability rules, and what it gets wrong is a strict expected failure below, with the reason.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.pytest_plugin import ParityRunner
from suites.parity.slices import TRAINING_LOOP


@pytest.mark.parity_matrix(TRAINING_LOOP)
def test_training_loop_parity(parity_case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(parity_case)
