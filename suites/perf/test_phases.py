"""A timed step split into forward, backward and optimizer without processes: the clock's marks on CPU, the
slowest rank's phases per step, their medians and sum, their summary over repetitions, and the table
printed under the step times (the CPU run that checks them end to end is in ``test_perf.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.perf.benchmark import RankTiming
from harness.perf.perf_rows import PerfRow, add_ratios, phase_table, summarize, summarize_row
from harness.perf.perf_run import row_from_values
from harness.perf.phases import (
    STEP_PHASES,
    StepClock,
    median_phase_sum,
    median_phases,
    phase_ratios,
    phases_by_name,
    slowest_rank_phases,
)


def test_the_phases_are_forward_backward_optimizer_in_order() -> None:
    assert STEP_PHASES == ("forward", "backward", "optimizer")


def test_a_cpu_clock_gives_one_host_time_per_phase_and_refuses_a_wrong_count_of_marks() -> None:
    clock = StepClock(torch.device("cpu"))
    for _ in range(2):  # reused step after step
        clock.start()
        for _ in STEP_PHASES:
            clock.mark()
        phases = clock.read()
        assert len(phases) == len(STEP_PHASES) and all(p >= 0 for p in phases)
    clock.start()
    clock.mark()
    with pytest.raises(RuntimeError, match="2 marks since start, 4 needed"):
        clock.read()
    clock.mark()
    clock.mark()
    with pytest.raises(RuntimeError, match="more than 3 marks"):
        clock.mark()


def test_each_step_takes_the_phases_of_its_slowest_rank_not_each_phases_slowest() -> None:
    step_s = [[0.3, 0.1, 0.2], [0.2, 0.4, 0.2]]
    phase_s = [[[0.1, 0.1, 0.1], [0.05, 0.02, 0.01], [0.1, 0.05, 0.05]],
               [[0.01, 0.15, 0.02], [0.2, 0.1, 0.1], [0.01, 0.1, 0.09]]]
    # Step 0: rank 0 (0.3 s); step 1: rank 1 (0.4 s); step 2: a tie, the lower rank.
    assert slowest_rank_phases(step_s, phase_s) == [[0.1, 0.1, 0.1], [0.2, 0.1, 0.1], [0.1, 0.05, 0.05]]
    with pytest.raises(ValueError, match="2 ranks' step times, 1 ranks' phases"):
        slowest_rank_phases(step_s, phase_s[:1])
    with pytest.raises(ValueError, match="different steps"):
        slowest_rank_phases(step_s, [phase_s[0], phase_s[1][:2]])


def test_medians_are_per_phase_and_the_sum_is_the_median_of_the_steps_sums() -> None:
    by_name = phases_by_name([[1, 5, 0.5], [5, 5, 0.5], [5, 1, 0.5]], scale=1000)
    assert by_name == {"forward": [1000, 5000, 5000], "backward": [5000, 5000, 1000], "optimizer": [500, 500, 500]}
    assert median_phases(by_name) == {"forward": 5000, "backward": 5000, "optimizer": 500}
    # Steps of 6.5, 10.5 and 6.5 s: the medians add up to 10.5, the steps' sums have median 6.5.
    assert median_phase_sum(by_name) == pytest.approx(6500)
    with pytest.raises(ValueError, match="3 phases"):
        phases_by_name([[1.0, 2.0]])
    assert phase_ratios({"forward": 2.0, "backward": 3.0, "optimizer": 1.0},
                        {"forward": 1.0, "backward": 0.0, "optimizer": 4.0}) == {"forward": 2.0, "optimizer": 0.25}


def _timing(step_s: list[float], phase_s: list[list[float]] | None) -> RankTiming:
    return RankTiming(step_s=step_s, losses=[5.0], device="CPU", phase_s=phase_s)


def test_a_row_reports_the_slowest_ranks_phases_in_ms_and_none_without_them() -> None:
    ranks = [_timing([0.10, 0.30], [[0.02, 0.06, 0.01], [0.1, 0.15, 0.04]]),
             _timing([0.20, 0.10], [[0.05, 0.12, 0.02], [0.03, 0.05, 0.01]])]
    row = row_from_values("builtin", "full_shard", ranks, None, None)
    assert row.steps_ms == pytest.approx([200, 300])
    assert row.steps_phase_ms == {"forward": pytest.approx([50, 100]), "backward": pytest.approx([120, 150]),
                                  "optimizer": pytest.approx([20, 40])}
    assert row.phase_ms == {"forward": pytest.approx(75), "backward": pytest.approx(135), "optimizer": pytest.approx(30)}
    assert row.phase_sum_ms == pytest.approx((190 + 290) / 2) and row.phase_sum_ms <= row.step_ms  # type: ignore[operator]
    unsplit = row_from_values("builtin", "full_shard", [ranks[0], _timing([0.2, 0.1], None)], None, None)
    assert unsplit.phase_ms is None and unsplit.steps_phase_ms is None and unsplit.phase_sum_ms is None


def _split(engine: str, step_ms: float, phases: tuple[float, float, float], strategy: str = "shard_grad_op") -> PerfRow:
    return PerfRow(engine, strategy, "ok", step_ms=step_ms, final_loss=5.0, steps_ms=[step_ms],
                   phase_ms=dict(zip(STEP_PHASES, phases)), phase_sum_ms=sum(phases),
                   steps_phase_ms={p: [v] for p, v in zip(STEP_PHASES, phases)})


def test_repetitions_fold_into_each_phases_median_and_every_step_kept() -> None:
    runs = [_split("builtin", 30.0, (10.0, 15.0, 3.0)), _split("builtin", 20.0, (6.0, 11.0, 2.0)),
            _split("builtin", 25.0, (8.0, 14.0, 1.0))]
    row = summarize_row(runs)
    assert row.phase_ms == {"forward": 8.0, "backward": 14.0, "optimizer": 2.0} and row.phase_sum_ms == 23.0
    assert row.steps_phase_ms == {"forward": [10.0, 6.0, 8.0], "backward": [15.0, 11.0, 14.0], "optimizer": [3.0, 2.0, 1.0]}
    one = summarize_row(runs[:1])
    assert one == runs[0] and one.phase_ms is not runs[0].phase_ms
    assert one.steps_phase_ms["forward"] is not runs[0].steps_phase_ms["forward"]  # type: ignore[index]
    # A repetition without phases: no phases in the summary rather than a median of the others.
    unsplit = dataclasses.replace(runs[1], phase_ms=None, phase_sum_ms=None, steps_phase_ms=None)
    assert summarize_row([runs[0], unsplit]).phase_ms is None


def test_the_phase_table_sets_each_phase_against_the_faster_torch_engine() -> None:
    rows = summarize([[_split("builtin", 101.0, (30.0, 60.0, 10.0)), _split("torch-fsdp", 110.0, (30.0, 66.0, 12.0)),
                       _split("torch-fsdp2", 100.0, (30.0, 50.0, 20.0)),
                       PerfRow("torch-fsdp", "no_shard", "timeout", "no answer")]], loss_rtol=1e-3)
    text = phase_table(rows, "host time")
    lines = text.splitlines()
    assert lines[0] == "phase ms (median over the timed steps, each step's slowest rank; host time):"
    assert [c.strip() for c in lines[1].strip("|").split("|")] == [
        "engine", "forward ms", "backward ms", "optimizer ms", "phases ms", "step ms",
        "x faster torch: forward / backward / optimizer"]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]] for line in lines[3:]}
    assert cells["builtin shard_grad_op"] == ["30.00", "60.00", "10.00", "100.00", "101.00", "1.000 / 1.200 / 0.500 (torch-fsdp2)"]
    assert cells["torch-fsdp2 shard_grad_op"][-1] == "-"  # the faster torch engine itself
    assert cells["torch-fsdp shard_grad_op"][-1] == "1.000 / 1.320 / 0.600 (torch-fsdp2)"
    assert "torch-fsdp no_shard" not in cells  # a row that did not run ok has no phases
    unsplit = [PerfRow("builtin", "full_shard", "ok", step_ms=10.0)]
    add_ratios(unsplit, 1e-3)
    assert phase_table(unsplit, "host time") == ""
