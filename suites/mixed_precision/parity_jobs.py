"""Rank-side job of the mixed-precision parity suite: the harness's own case job, with ``ParityNet``
registered in the zoo first (the pool pickles module-level functions by name)."""

from __future__ import annotations

from harness.case import CaseConfig
from harness.parity import RankResult, run_case_on_rank
from harness.rank import RankContext
from suites.mixed_precision.models import ensure_registered


def run_parity_case(ctx: RankContext, case: CaseConfig) -> RankResult:
    """``harness.parity.run_case_on_rank`` with ``ParityNet`` in this rank's zoo."""
    ensure_registered()
    return run_case_on_rank(ctx, case)
