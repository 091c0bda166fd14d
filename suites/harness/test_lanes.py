"""Pools side by side change when a case runs, never what it computes: a sample of cases run on one
lane and on two lanes gives records whose every compared quantity is bitwise the same."""

from __future__ import annotations

import time
from typing import Any

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.compare.phases import TIMING_DETAIL
from harness.ranks.placement import Lane
from harness.run.runner import CaseRunner, Progress, Selection, select_cases



class _Records:
    """A writer that keeps the records in memory (``CaseRunner`` only calls ``append``)."""

    def __init__(self) -> None:
        self.records: dict[str, CaseRecord] = {}

    def append(self, record: CaseRecord) -> None:
        case = CaseConfig.from_dict(record.case)
        self.records[case.full_id] = record


def _run(cases: list[CaseConfig], lanes: int) -> dict[str, CaseRecord]:
    writer = _Records()
    runner = CaseRunner(writer, Progress(len(cases), enabled=False), None, case_timeout_s=240.0)
    not_run, failed = runner.run_all({2: [Lane(2, "gloo", None)] * lanes}, cases)
    assert not not_run and not failed, (not_run, runner.lane_errors)
    assert runner.recorded == len(cases)
    return writer.records


def _quantities(record: CaseRecord) -> dict[str, Any]:
    return {
        "verdict": record.verdict, "reason": record.reason, "deterministic": record.deterministic,
        "errors": [(e.name, e.max_abs, e.max_rel, e.atol, e.rtol, e.passed, e.ratio) for e in record.errors],
        "bytes": (record.bytes_all_gathered, record.bytes_reduce_scattered, record.peak_mem_bytes),
        "detail": {k: v for k, v in record.detail.items() if k not in TIMING_DETAIL},
    }


def test_one_lane_and_two_lanes_give_bitwise_the_same_records() -> None:
    # Tiny and varied: two engines, both references, sharded and mixed-precision cases, 2 steps.
    picked = select_cases(Selection(matrix="smoke", engines=["builtin", "torch-fsdp"], steps=2), [2])
    # Mixed precision is judged against the local reference only (against DDP it is unsupported).
    cases = [c for c in picked if not c.cpu_offload and (c.precision == "fp32" or c.reference == "local")][:4]
    assert len({c.engine for c in cases}) == 2
    one, two = _run(cases, lanes=1), _run(cases, lanes=2)
    assert set(one) == set(two) == {c.full_id for c in cases}
    for full_id in one:
        assert one[full_id].errors, f"{full_id}: nothing compared, so nothing to check"
        assert _quantities(one[full_id]) == _quantities(two[full_id]), full_id


def test_no_more_pools_start_than_there_are_cases() -> None:
    cases = select_cases(Selection(matrix="smoke", engines=["builtin"], references=["ddp"], models=["nested"], steps=1),
                         [2])[:1]
    writer, opened = _Records(), []
    runner = CaseRunner(writer, Progress(len(cases), enabled=False), None, case_timeout_s=240.0)

    def open_pool(lane: Lane) -> Any:
        opened.append(lane)
        return runner._rank_pool(lane)

    runner.open_pool = open_pool
    not_run, failed = runner.run_all({2: [Lane(2, "gloo", None)] * 3}, cases)
    assert not not_run and not failed and runner.recorded == 1, (not_run, runner.lane_errors)
    assert len(opened) == 1, f"{len(opened)} pools started for one case"


def test_the_run_header_names_the_pools_that_start() -> None:
    from harness.cli.run import lane_text

    cases = select_cases(Selection(matrix="smoke", engines=["builtin"], references=["ddp"], models=["nested"], steps=1),
                         [2])[:2]
    lanes = {2: [Lane(2, "nccl", (2 * i % 4, 2 * i % 4 + 1)) for i in range(16)], 4: [Lane(4, "nccl", (0, 1, 2, 3))]}
    assert lane_text(lanes, cases) == "2 pool(s) of 2 ranks (nccl on GPUs [0, 1, 2, 3] (one per rank))"
    assert lane_text(lanes, []) == "no pool (nothing to run)"


class _UnusedPool:
    """A pool that is entered and left but never given a case (the lanes find the budget spent); its
    ranks take ``CLOSE_S`` to exit."""

    CLOSE_S = 0.2

    def __enter__(self) -> "_UnusedPool":
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(self.CLOSE_S)


def test_no_pool_starts_after_the_deadline() -> None:
    """The world sizes run one after the other: once the budget is spent while one world size's pools
    start, the next world size's pools never start (on a loaded GPU node each start took seconds)."""
    cases = select_cases(Selection(matrix="smoke", engines=["builtin"], references=["ddp"], models=["nested"], steps=1),
                         [2, 4])
    assert {c.world_size for c in cases} == {2, 4}
    runner = CaseRunner(_Records(), Progress(len(cases), enabled=False), time.monotonic() + 3600, case_timeout_s=240.0)
    opened: list[int] = []

    def open_pool(lane: Lane) -> Any:
        opened.append(lane.world_size)
        runner.deadline = time.monotonic()  # the budget runs out while this pool starts
        return _UnusedPool()

    runner.open_pool = open_pool
    not_run, failed = runner.run_all({2: [Lane(2, "gloo", None)], 4: [Lane(4, "gloo", None)]}, cases, budget_s=1.0)
    assert opened == [2], f"pools started for world sizes {opened} after the budget was spent"
    assert not failed and runner.recorded == 0
    assert sorted(c.full_id for c, _ in not_run) == sorted(c.full_id for c in cases)
    assert {why for _, why in not_run} == {"time budget of 1 s spent"}
    # The pool's closing, after the deadline, is counted where the nightly's time budget can see it.
    assert _UnusedPool.CLOSE_S <= runner.close_s < 10 * _UnusedPool.CLOSE_S
