"""Parity of every engine with torch FSDP1's API (``fsdp_api``) against the emulating reference for
every precision config of the harness matrix (``harness.case.PRECISIONS``), on the final parameters,
under a tolerance derived per config from the distance between the emulating reference and the
float64 reference (tightened by the single-cast ablations, see :mod:`suites.mixed_precision.reference`).

Per config: four engine cases (strategies, use_orig_params, CPU offload and prefetch settings
spread over them; the two offload ones are their own test id, which skips for torch FSDP1 on CPU
ranks, where its offload cannot pin memory) must pass. For mixed configs, guard cases run the
engine with casts dropped (all, then each one); every guard whose dropped cast changes the numbers
must fail, which shows the comparison would catch an engine that ignores it. A dropped cast with
no numerical effect on this model (e.g. a bfloat16 buffer that the model casts to bfloat16 anyway)
is reported, not asserted. Each case's tolerance is recorded with its result (``record_property``,
and a table in the output).
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.case import PRECISIONS
from harness.pool import RankPool
from suites.mixed_precision import jobs
from suites.mixed_precision.cases import check_parity_records, parity_payload
from suites.mixed_precision.jobs import assert_ok


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_parity_with_emulating_reference(
    cpu_pair: RankPool, fsdp_api: str, precision: str, offload: bool, record_property: Any
) -> None:
    outcome = cpu_pair.run(jobs.parity_precision, parity_payload(fsdp_api, precision, offload))
    check_parity_records(assert_ok(outcome), record_property, guards=not offload)
