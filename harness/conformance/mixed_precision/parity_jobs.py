"""Rank-side job of the mixed-precision parity suite: the harness's own case job, from a module whose
import registers ``ParityNet`` in the rank's zoo (the pool pickles module-level functions by name, so
unpickling this job imports it)."""

from __future__ import annotations

from harness.cases.case import CaseConfig
from harness.compare.parity import RankResult, run_case_on_rank
from harness.ranks.rank import RankContext
# Imported for its side effect: it registers ParityNet (PARITY_NET) in this process's zoo.
import harness.conformance.mixed_precision.models  # noqa: F401


def run_parity_case(ctx: RankContext, case: CaseConfig) -> RankResult:
    """``harness.compare.parity.run_case_on_rank`` with ``ParityNet`` (``PARITY_NET``) in this rank's zoo."""
    return run_case_on_rank(ctx, case)
