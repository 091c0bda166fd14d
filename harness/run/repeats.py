"""Repeated runs of one case and the ``flaky`` verdict.

A case run several times (``--repeat N``; ``--repeat-failures N`` reruns the ones that did not pass)
gives one record per run; ``merge_runs`` folds them into the one record the results file keeps. When
every run agrees, that verdict stands. When they disagree, the verdict is ``flaky`` with the count of
each outcome (``CaseRecord.outcomes``), whatever the majority: a race that shows once in five runs is a
bug that shows once in five nightlies, so a flaky case is never a pass. Pure functions over records.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from harness.cases.records import FAILING, CaseRecord
from harness.compare.phases import BEFORE_JOB, add_phases

__all__ = ["decide", "merge_runs", "needs_rerun", "outcome_text"]

def decide(verdicts: Sequence[str]) -> tuple[str, dict[str, int]]:
    """The verdict of a case from the verdicts of its runs, and the count of each (in first-seen order)."""
    if not verdicts:
        raise ValueError("decide: verdicts is empty; a case must have run at least once")
    counts = dict(collections.Counter(verdicts))
    return (verdicts[0] if len(counts) == 1 else "flaky"), counts


def outcome_text(counts: dict[str, int]) -> str:
    """``pass 3, fail 2``."""
    return ", ".join(f"{verdict} {n}" for verdict, n in counts.items())


def needs_rerun(record: CaseRecord) -> bool:
    """Whether ``--repeat-failures`` reruns a case after this (merged) record: a failing one (it leaves
    alone a pass, or a case the engine cannot express)."""
    return record.verdict in FAILING


def merge_runs(runs: Sequence[CaseRecord]) -> CaseRecord:
    """One record for every run of one case.

    One run: that record, unchanged. Several: the verdict of ``decide``, ``outcomes`` set, and the
    body (errors, reason, details) of the first run that did not pass, so a flaky case shows how it
    failed; ``detail["runs"]`` keeps each run's verdict, reason and wall time, ``wall_s`` is their sum.
    """
    if not runs:
        raise ValueError("merge_runs: no runs to merge")
    if len(runs) == 1:
        return runs[0]
    ids = {r.case_id for r in runs}
    if len(ids) != 1:
        raise ValueError(f"merge_runs: runs of different cases {sorted(ids)}; merge the runs of one case")
    verdict, counts = decide([r.verdict for r in runs])
    body = next((r for r in runs if r.verdict != "pass"), runs[0])
    reason = body.reason
    if verdict == "flaky":
        reason = f"runs disagree ({outcome_text(counts)}); first {body.verdict}: {body.reason}".rstrip(": ")
    detail = {**body.detail, "runs": [{"verdict": r.verdict, "reason": r.reason, "wall_s": r.wall_s} for r in runs]}
    measured = [r.detail for r in runs if "phases_s" in r.detail]
    if measured:
        # ``wall_s`` is every run's, so the phases and the hand-off are too (a run without them, a timeout, stays
        # outside them: ``harness.collect.breakdown`` counts it unmeasured).
        detail["phases_s"] = add_phases([d["phases_s"] for d in measured])
        detail["handoff_s"] = sum(float(d.get("handoff_s", 0.0)) for d in measured)
        for key in BEFORE_JOB:
            waited = sum(float(d.get(key, 0.0)) for d in measured)
            if waited:
                detail[key] = waited
    return CaseRecord(
        case=body.case, case_id=body.case_id, verdict=verdict, reason=reason, run=body.run, time=body.time,  # type: ignore[arg-type]
        errors=body.errors, deterministic=body.deterministic, wall_s=sum(r.wall_s for r in runs),
        peak_mem_bytes=max(r.peak_mem_bytes for r in runs), bytes_all_gathered=body.bytes_all_gathered,
        bytes_reduce_scattered=body.bytes_reduce_scattered, detail=detail, outcomes=counts,
    )
