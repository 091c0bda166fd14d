"""``python -m harness perf --repeats N`` without processes: the interleaved order of the repetitions, their
summary (medians, min..max, largest peak memory), the paired ratios against torch FSDP1 and against the
faster torch engine (chosen per strategy; one that failed or ran out of memory is never the faster), and
the lines printed, from known rows (the CPU run with ``--repeats 2`` is in ``test_perf.py``)."""

from __future__ import annotations

import statistics

import pytest

from harness.perf.perf_rows import (
    PerfRow,
    add_ratios,
    faster_torch,
    ratio_lines,
    summarize,
    summarize_row,
    table,
)
from harness.perf.perf_run import plan_runs


def _ok(engine: str, strategy: str | None, step_ms: float, *, loss: float = 5.0, peak: float | None = None,
        model: str = "") -> PerfRow:
    return PerfRow(engine, strategy, "ok", model=model, step_ms=step_ms, min_ms=step_ms - 1, p10_ms=step_ms - 0.5,
                   p90_ms=step_ms + 0.5, max_ms=step_ms + 1, peak_gib=peak, reserved_gib=peak, tokens_per_s=1000 / step_ms,
                   tflops=2 / step_ms, final_loss=loss, steps_ms=[step_ms, step_ms])


def _reps(times: dict[tuple[str, str], list[float]]) -> list[list[PerfRow]]:
    """One list of rows per repetition from ``{(engine, strategy): [ms of rep 1, rep 2, ...]}``."""
    n = len(next(iter(times.values())))
    return [[_ok(e, s, ms[i]) for (e, s), ms in times.items()] for i in range(n)]


def test_each_repetition_rotates_the_engines_within_a_strategy_and_ddp_stays_last() -> None:
    engines = ["builtin", "torch-fsdp", "torch-fsdp2", "ddp"]
    plans = [plan_runs(engines, ["full_shard", "shard_grad_op"], r) for r in range(4)]
    assert plans[0] == plan_runs(engines, ["full_shard", "shard_grad_op"])  # repetition 0 is today's order
    assert [e for e, s in plans[1] if s == "full_shard"] == ["torch-fsdp", "torch-fsdp2", "builtin"]
    assert [e for e, s in plans[2] if s == "shard_grad_op"] == ["torch-fsdp2", "builtin", "torch-fsdp"]
    assert plans[3][:3] == plans[0][:3] and all(p[-1] == ("ddp", None) for p in plans)
    # Over as many repetitions as engines, every engine runs once in every position of its strategy.
    positions = {e: sorted(p.index((e, "full_shard")) for p in plans[:3]) for e in engines[:3]}
    assert all(v == [0, 1, 2] for v in positions.values())
    assert sorted(plans[1]) == sorted(plans[0])  # the same runs, only the order differs
    assert plan_runs(["builtin", "torch-fsdp"], ["full_shard"], 1) == [("torch-fsdp", "full_shard"), ("builtin", "full_shard")]


def test_a_summary_is_the_median_of_the_repetitions_with_their_range_and_the_largest_peak() -> None:
    runs = [_ok("builtin", "full_shard", ms, peak=p, loss=l)
            for ms, p, l in ((30.0, 2.0, 5.0), (10.0, 4.0, 5.2), (20.0, 3.0, 5.1))]
    row = summarize_row(runs)
    assert (row.step_ms, row.min_ms, row.max_ms, row.repeats) == (20.0, 10.0, 30.0, 3)
    assert row.p10_ms == pytest.approx(12.0) and row.p90_ms == pytest.approx(28.0)
    assert row.peak_gib == 4.0 and row.reserved_gib == 4.0 and row.final_loss == 5.1
    assert row.tokens_per_s == pytest.approx(1000 / 20) and row.tflops == pytest.approx(2 / 20)  # at the median
    assert row.steps_ms == [30.0, 30.0, 10.0, 10.0, 20.0, 20.0]
    assert summarize_row(runs[:1]) == runs[0] and summarize_row(runs[:1]) is not runs[0]


def test_a_repetition_that_did_not_run_ok_makes_the_summary_not_ok_and_names_it() -> None:
    oom = PerfRow("torch-fsdp2", "shard_grad_op", "error", "OutOfMemoryError: CUDA out of memory")
    row = summarize_row([_ok("torch-fsdp2", "shard_grad_op", 10.0), oom, _ok("torch-fsdp2", "shard_grad_op", 11.0)])
    assert row.status == "error" and row.reason == "repetition 2 of 3: OutOfMemoryError: CUDA out of memory"
    assert row.step_ms is None and row.repeats == 3
    unsupported = summarize_row([PerfRow("builtin", "hybrid_shard", "unsupported", "needs 4 ranks")] * 2)
    assert (unsupported.status, unsupported.reason) == ("unsupported", "needs 4 ranks")


def test_ratios_are_paired_per_repetition_not_taken_of_the_medians() -> None:
    reps = _reps({("builtin", "full_shard"): [10.0, 20.0, 30.0], ("torch-fsdp", "full_shard"): [11.0, 19.0, 40.0]})
    ours = summarize(reps, loss_rtol=1e-3)[0]
    assert ours.step_ms == 20.0 and ours.ratio == pytest.approx(10 / 11)  # the medians' ratio would be 20 / 19
    assert (ours.ratio_min, ours.ratio_max) == (pytest.approx(0.75), pytest.approx(20 / 19))
    assert ours.loss_matches is True and ours.faster_torch == "torch-fsdp" and ours.faster_ratio == ours.ratio


def test_the_faster_torch_engine_is_chosen_per_strategy() -> None:
    reps = _reps({("builtin", "full_shard"): [100.0, 102.0, 98.0], ("torch-fsdp", "full_shard"): [104.0, 105.0, 103.0],
                  ("torch-fsdp2", "full_shard"): [101.0, 103.0, 99.0],
                  ("builtin", "shard_grad_op"): [90.0, 91.0, 92.0], ("torch-fsdp", "shard_grad_op"): [95.0, 94.0, 96.0],
                  ("torch-fsdp2", "shard_grad_op"): [97.0, 98.0, 96.5]})
    rows = summarize(reps, loss_rtol=1e-3)
    assert faster_torch(rows, "", "full_shard") == "torch-fsdp2" and faster_torch(rows, "", "shard_grad_op") == "torch-fsdp"
    by = {r.label: r for r in rows}
    full = by["builtin full_shard"]
    assert full.faster_torch == "torch-fsdp2"
    assert full.faster_ratio == pytest.approx(statistics.median([100 / 101, 102 / 103, 98 / 99]))
    assert full.ratio == pytest.approx(statistics.median([100 / 104, 102 / 105, 98 / 103]))
    assert by["builtin shard_grad_op"].faster_torch == "torch-fsdp"
    assert by["torch-fsdp2 full_shard"].faster_ratio == 1.0 and by["torch-fsdp full_shard"].faster_ratio > 1
    # A tie goes to torch FSDP1; no torch engine at a strategy: no faster one.
    tie = [_ok("torch-fsdp2", "full_shard", 10.0), _ok("torch-fsdp", "full_shard", 10.0)]
    assert faster_torch(tie, "", "full_shard") == "torch-fsdp" and faster_torch(tie, "", "no_shard") is None


def test_a_torch_engine_that_failed_or_ran_out_of_memory_is_not_the_faster() -> None:
    reps = _reps({("builtin", "shard_grad_op"): [100.0, 100.0], ("torch-fsdp", "shard_grad_op"): [110.0, 112.0],
                  ("torch-fsdp2", "shard_grad_op"): [50.0, 50.0]})
    reps[1][2] = PerfRow("torch-fsdp2", "shard_grad_op", "error", "OutOfMemoryError: CUDA out of memory")
    rows = summarize(reps, loss_rtol=1e-3)
    ours = rows[0]
    assert rows[2].status == "error" and faster_torch(rows, "", "shard_grad_op") == "torch-fsdp"
    assert ours.faster_torch == "torch-fsdp" and ours.faster_ratio == pytest.approx(statistics.median([100 / 110, 100 / 112]))
    lines = ratio_lines(rows)
    assert lines[1].startswith("ratio builtin / faster torch (torch-fsdp) step time (shard_grad_op): 0.901 (median of 2; "
                               "per-rep ratios 0.893..0.909; 100.00 vs 111.00 ms medians); torch-fsdp2 error: repetition 2 of 2: "
                               "OutOfMemoryError"), lines


def test_when_neither_torch_engine_ran_the_lines_say_so_instead_of_dividing() -> None:
    rows = [_ok("builtin", "full_shard", 10.0), PerfRow("torch-fsdp", "full_shard", "timeout", "no answer")]
    add_ratios(rows, 1e-3)
    assert rows[0].ratio is None and rows[0].faster_ratio is None and rows[0].faster_torch is None
    assert ratio_lines(rows) == [
        "ratio builtin / torch-fsdp (full_shard): not measured (torch-fsdp full_shard did not run ok)",
        "ratio builtin / faster torch (full_shard): not measured (neither torch-fsdp nor torch-fsdp2 full_shard ran ok: "
        "torch-fsdp timeout: no answer; torch-fsdp2 not run)",
    ]
    alone = [_ok("builtin", "full_shard", 10.0)]
    add_ratios(alone, 1e-3)
    assert ratio_lines(alone)[0] == "ratio builtin / torch-fsdp (full_shard): not measured (torch-fsdp full_shard not run)"


def test_one_repetition_prints_todays_lines_plus_the_faster_torch_one() -> None:
    rows = [_ok("builtin", "full_shard", 190.3), _ok("torch-fsdp", "full_shard", 190.6), _ok("ddp", None, 150.0)]
    summary = summarize([rows], loss_rtol=1e-3)
    assert [r.ratio for r in summary] == [pytest.approx(190.3 / 190.6), 1.0, pytest.approx(150 / 190.6)]
    assert ratio_lines(summary) == [
        "ratio builtin / torch-fsdp step time (full_shard): 0.998 (190.30 ms vs 190.60 ms, same run)",
        "ratio builtin / faster torch (torch-fsdp) step time (full_shard): 0.998 (190.30 ms vs 190.60 ms, same run); "
        "torch-fsdp2 not run",
    ]
    assert "p10..p90 ms" in table(summary) and "x faster torch" in table(summary)


def test_a_final_loss_that_differs_in_any_repetition_differs() -> None:
    reps = _reps({("builtin", "full_shard"): [10.0, 10.0], ("torch-fsdp", "full_shard"): [10.0, 10.0]})
    reps[1][0].final_loss = 5.5
    assert summarize(reps, loss_rtol=1e-3)[0].loss_matches is False
    assert summarize(reps[:1], loss_rtol=1e-3)[0].loss_matches is True


def test_the_table_of_several_repetitions_shows_their_range_and_the_repetitions_must_match() -> None:
    reps = _reps({("builtin", "full_shard"): [10.0, 12.0, 11.0], ("torch-fsdp", "full_shard"): [11.0, 11.0, 11.0]})
    text = table(summarize(reps, loss_rtol=1e-3))
    assert "step ms (median of 3)" in text and "min..max of 3 ms" in text and "10.00..12.00" in text
    assert "1.000 (torch-fsdp)" in text
    with pytest.raises(ValueError, match="repetition 2 ran"):
        summarize([reps[0], reps[1][:1]], loss_rtol=1e-3)
