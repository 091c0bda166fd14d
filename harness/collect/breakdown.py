"""Where a run's case time went, summed over its records: the first measurement of issue 39.

Each record of a case that ran keeps its busiest rank's phases (``detail["phases_s"]``, seconds:
``harness.compare.phases``) and the pool's hand-off (``detail["handoff_s"]``); the runner adds up the
seconds it spent writing records (``harness.run.runner.CaseRunner.records_s``). ``breakdown`` folds them into one
row each (pure: plain data in, plain data out, what ``nightly.json`` keeps under ``cases.breakdown``) and
``breakdown_table`` renders it:

- a row per phase, then ``handoff`` (job sent, answers back, waiting for the slowest rank), ``pool_start`` (a
  pool's ranks started for the case's job, on a pool's first job or after a reset, ``detail["pool_start_s"]``),
  ``slot_wait`` (waiting for GPU slots before the job was sent, ``detail["slot_wait_s"]``: only under a
  pytest-xdist run's ``harness.ranks.gpu_slots``), both outside the record's wall time, ``records`` (writing
  and syncing each record) and ``unmeasured`` (the part of a case's wall time outside its phases and hand-off: all
  of a case that timed out, crashed or raised on a rank, or whose record predates the phases);
- per row the total seconds, the mean per case and the share of the case time, which is the rows' sum (the
  case time of several pools side by side adds up beyond the wall time: ``cases_in_flight`` says how far).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.cases.records import CaseRecord
from harness.compare.phases import BEFORE_JOB, PHASES

__all__ = ["ROWS", "breakdown", "breakdown_table"]

#: the row of each wait before the job (``BEFORE_JOB``'s key without its ``_s``): ``pool_start``, ``slot_wait``.
WAIT_ROWS: dict[str, str] = {key: key.removesuffix("_s") for key in BEFORE_JOB}
#: the rows of a breakdown, in the order a case meets them.
ROWS: tuple[str, ...] = (*PHASES, "handoff", *WAIT_ROWS.values(), "records", "unmeasured")


def breakdown(records: Sequence[CaseRecord], records_s: float, cases_wall_s: float) -> dict[str, Any]:
    """``{"cases", "case_s", "cases_wall_s", "cases_in_flight", "rows": {row: {"total_s", "mean_s", "share"}}}``
    over ``records`` (the cases of one run), ``records_s`` (the seconds spent writing them) and ``cases_wall_s``
    (the wall time the cases took, pools side by side)."""
    if records_s < 0:
        raise ValueError(f"breakdown: records_s={records_s} must be >= 0 (seconds spent writing records)")
    if cases_wall_s < 0:
        raise ValueError(f"breakdown: cases_wall_s={cases_wall_s} must be >= 0 (the cases' wall time)")
    totals = dict.fromkeys(ROWS, 0.0)
    for record in records:
        phases: Mapping[str, float] = record.detail.get("phases_s") or {}
        handoff = float(record.detail.get("handoff_s", 0.0))
        for phase in PHASES:
            totals[phase] += float(phases.get(phase, 0.0))
        totals["handoff"] += handoff
        for key, row in WAIT_ROWS.items():
            totals[row] += float(record.detail.get(key, 0.0))
        # Clamped: records written before the phases were the busiest rank's kept each phase's slowest rank,
        # whose sum could exceed the round trip; that overlap is no time outside the phases.
        totals["unmeasured"] += max(record.wall_s - sum(phases.values()) - handoff, 0.0)
    totals["records"] = records_s
    case_s = sum(totals.values())
    n = len(records)
    rows = {row: {"total_s": round(total, 3), "mean_s": round(total / n, 4) if n else 0.0,
                  "share": round(total / case_s, 4) if case_s > 0 else 0.0} for row, total in totals.items()}
    return {"cases": n, "case_s": round(case_s, 3), "cases_wall_s": round(cases_wall_s, 3),
            "cases_in_flight": round(case_s / cases_wall_s, 2) if cases_wall_s > 0 else None, "rows": rows}


def breakdown_table(result: Mapping[str, Any]) -> str:
    """``breakdown``'s result as a table (one row per phase, hand-off, records and unmeasured, then the sum)
    and a line on the cases' concurrency."""
    from tabulate import tabulate

    rows = [(name, row["total_s"], row["mean_s"], f"{100 * row['share']:.1f}%") for name, row in result["rows"].items()]
    rows.append(("all", result["case_s"], result["case_s"] / result["cases"] if result["cases"] else 0.0, "100.0%"))
    table = tabulate(rows, headers=("where", "total s", "mean s/case", "share"), floatfmt=(None, ".3f", ".4f"),
                     colalign=("left", "right", "right", "right"))
    in_flight = result.get("cases_in_flight")
    return (f"{table}\n{result['cases']} cases: {result['case_s']:.1f} s of case time in {result['cases_wall_s']:.1f} s "
            f"of wall time ({in_flight if in_flight is not None else '-'} cases in flight on average)")
