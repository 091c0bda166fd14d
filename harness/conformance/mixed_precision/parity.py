"""Parity of every engine with torch FSDP1's API (``fsdp_api``) against the harness's emulating
reference for every precision config of the harness matrix (``harness.cases.case.PRECISIONS``), on
``ParityNet`` (whose float buffer the model casts itself, so every one of the three casts moves the
numbers), under the harness's one tolerance rule (``harness.compare.tolerance``: half the distance from the
emulation to the nearest run that drops casts).

Per config: the engine cases (strategies, use_orig_params, CPU offload and prefetch settings spread
over them; the offload ones are their own test id, which skips for torch FSDP1 on CPU ranks, where its
offload cannot pin memory) must pass. For mixed configs, guard cases run the engine with casts dropped
(all, then each ``MixedPrecision`` field) and the knob checks off: every guard whose dropped cast
changes the numbers must fail on values alone, which shows the comparison would catch an engine that
ignores it. A dropped cast with no numerical effect (reduce_dtype equal to param_dtype) is reported,
not asserted.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.cases.case import PRECISIONS
from harness.compare.parity import record_from_outcome
from harness.conformance.mixed_precision import parity_jobs
from harness.conformance.mixed_precision.cases import check_parity_records, parity_cases
from harness.conformance.mixed_precision.pools import cpu_pair
from harness.ranks.pool import RankPool

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["cpu_pair", "test_parity_with_emulating_reference"]


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_parity_with_emulating_reference(
    cpu_pair: RankPool, fsdp_api: str, precision: str, offload: bool, record_property: Any
) -> None:
    results = [
        (dropped, record_from_outcome(case, cpu_pair.run(parity_jobs.run_parity_case, case)))
        for dropped, case in parity_cases(fsdp_api, precision, offload)
    ]
    if all(r.verdict == "unsupported" for _, r in results):
        pytest.skip(reason=results[0][1].reason)
    check_parity_records(fsdp_api, precision, results, record_property)
