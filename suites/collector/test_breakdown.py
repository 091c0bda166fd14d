"""Where a case's time goes (issue 39): the ranks' phase clock, the busiest rank's phases and the pool's
hand-off (``harness.compare.phases``), a repeated case's phases added up (``harness.run.repeats``), and the
run's breakdown over hand-made records and its table (``harness.collect.breakdown``)."""

from __future__ import annotations

import math

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.collect.breakdown import ROWS, breakdown, breakdown_table
from harness.compare.phases import PHASES, PhaseClock, before_job_s, busiest, handoff_s
from harness.run.repeats import merge_runs

CASE = CaseConfig()


def _phases(**seconds: float) -> dict[str, float]:
    return {phase: seconds.get(phase, 0.0) for phase in PHASES}


def _record(wall_s: float, phases: dict[str, float] | None, handoff: float | None = None,
            verdict: str = "pass") -> CaseRecord:
    detail = {} if phases is None else {"phases_s": phases, "handoff_s": handoff if handoff is not None else 0.0}
    return CaseRecord(CASE.to_dict(), CASE.case_id, verdict, wall_s=wall_s, detail=detail)  # type: ignore[arg-type]


def test_the_clock_tiles_a_job_into_every_phase() -> None:
    clock = PhaseClock()
    for phase in ("setup", "reference", "steps", "steps"):
        clock.lap(phase)
    assert list(clock.seconds) == list(PHASES) and clock.seconds["build"] == clock.seconds["determinism"] == 0.0
    assert all(s >= 0 for s in clock.seconds.values())
    with pytest.raises(ValueError, match="phase='warmup'"):
        clock.lap("warmup")


def test_a_phase_carved_out_of_another_keeps_the_job_tiled() -> None:
    clock = PhaseClock()
    clock.seconds["steps"] = 2.0
    clock.move(0.5, "steps", "observe")
    assert (clock.seconds["steps"], clock.seconds["observe"]) == (1.5, 0.5)
    with pytest.raises(ValueError, match="within steps's 1.5"):
        clock.move(1.6, "steps", "observe")
    with pytest.raises(ValueError, match="phase='warmup'"):
        clock.move(0.1, "warmup", "observe")


def test_the_busiest_ranks_phases_and_a_hand_off_never_below_zero() -> None:
    ranks = [_phases(reference=2.0, steps=1.0), _phases(reference=1.0, steps=2.5)]
    assert busiest(ranks) == ranks[1], "the rank whose job took longest, not each phase's slowest"
    # A copy, not the rank's own mapping; a rank that answered before its clock started (world size mismatch).
    assert busiest([ranks[1], ranks[1]]) is not ranks[1] and busiest([{}]) == _phases()
    assert handoff_s(4.0, ranks) == pytest.approx(0.5)  # against the busiest rank's 3.5 s
    # A round trip read a hair shorter than the phases (two clocks): no time, not negative time.
    assert handoff_s(3.4999, ranks) == 0.0 and handoff_s(0.0, []) == 0.0


def test_a_repeated_case_adds_up_its_runs_phases_and_a_timed_out_run_stays_unmeasured() -> None:
    runs = [_record(1.0, _phases(steps=0.5), 0.25), _record(3.0, None, verdict="timeout"),
            _record(1.0, _phases(steps=0.75), 0.125)]
    merged = merge_runs(runs)
    assert merged.detail["phases_s"] == _phases(steps=1.25) and merged.detail["handoff_s"] == 0.375
    rows = breakdown([merged], 0.0, 5.0)["rows"]
    assert rows["unmeasured"]["total_s"] == pytest.approx(5.0 - 1.25 - 0.375)


@pytest.mark.parametrize("row", ["pool_start", "slot_wait"])
def test_a_wait_before_the_job_is_its_own_row_outside_the_wall_time(row: str) -> None:
    """A job waits before it is sent for its pool's start (a pool starts on its first job) or, under a
    pytest-xdist run's GPU slots, for its slots: time the case held its lane, which its wall time (the pool's
    round trip) leaves out; repeated runs add their waits up."""
    key = f"{row}_s"
    waited = _record(1.0, _phases(steps=0.5), 0.25)
    waited.detail[key] = 2.0
    merged = merge_runs([waited, _record(1.0, _phases(steps=0.5), 0.25)])
    assert merged.detail[key] == 2.0 and before_job_s(merged.detail) == 2.0
    rows = breakdown([merged, _record(1.0, _phases(steps=1.0), 0.0)], 0.0, 5.0)["rows"]
    assert rows[row]["total_s"] == pytest.approx(2.0)
    assert rows["unmeasured"]["total_s"] == pytest.approx(2.0 - 1.0 - 0.5)  # the wait is no part of it
    assert key not in merge_runs([_record(1.0, _phases(steps=0.5), 0.25)]).detail


def test_breakdown_over_hand_made_records() -> None:
    records = [
        _record(2.0, _phases(setup=0.1, reference=0.9, build=0.1, steps=0.5, compare=0.2), handoff=0.2),
        _record(1.5, _phases(setup=0.1, reference=0.2, build=0.1, steps=0.6, compare=0.1, determinism=0.3), 0.1),
        # Each phase its slowest rank: together more than the busiest rank, whose job the hand-off was
        # measured against; the overlap is not time outside the phases.
        _record(1.0, _phases(reference=0.6, steps=0.6), handoff=0.0),
        _record(0.05, _phases(setup=0.04), handoff=0.01, verdict="unsupported"),
        _record(30.0, None, verdict="timeout"),  # no phases: all of it unmeasured
    ]
    result = breakdown(records, records_s=0.05, cases_wall_s=20.0)
    rows = result["rows"]
    assert list(rows) == list(ROWS) and result["cases"] == 5
    assert rows["reference"]["total_s"] == pytest.approx(1.7) and rows["reference"]["mean_s"] == pytest.approx(0.34)
    assert rows["handoff"]["total_s"] == pytest.approx(0.31) and rows["records"]["total_s"] == pytest.approx(0.05)
    assert rows["unmeasured"]["total_s"] == pytest.approx(30.0)
    assert all(row["total_s"] >= 0 and row["share"] >= 0 for row in rows.values())
    assert math.isclose(sum(row["share"] for row in rows.values()), 1.0, abs_tol=1e-3)
    assert result["case_s"] == pytest.approx(sum(row["total_s"] for row in rows.values()), abs=1e-3)
    assert result["cases_in_flight"] == pytest.approx(result["case_s"] / 20.0, abs=0.01)

    table = breakdown_table(result)
    assert all(row in table for row in ROWS) and "100.0%" in table and "5 cases" in table


def test_breakdown_of_no_case_and_bad_arguments() -> None:
    empty = breakdown([], 0.0, 0.0)
    assert empty["cases"] == 0 and empty["case_s"] == 0 and empty["cases_in_flight"] is None
    assert all(row == {"total_s": 0.0, "mean_s": 0.0, "share": 0.0} for row in empty["rows"].values())
    assert "0 cases" in breakdown_table(empty)
    with pytest.raises(ValueError, match="records_s=-1"):
        breakdown([], -1.0, 1.0)
    with pytest.raises(ValueError, match="cases_wall_s=-2"):
        breakdown([], 0.0, -2.0)
