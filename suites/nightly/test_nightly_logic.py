"""The nightly's pure logic: which pools run, which earlier nightly is the baseline, the fuzz totals
and the exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli.nightly import (
    NightlyConfig,
    baseline_source,
    exit_status,
    find_previous,
    parse_fuzz_totals,
)
from harness.placement import CPU_WORLD_SIZE, Lane, plan_lanes
from suites.flat_param.campaign import PropertyRun, report


def test_cpu_runs_one_gloo_pool_of_two_ranks_and_says_what_it_leaves_out() -> None:
    lanes, skipped = plan_lanes(None, "auto", n_gpus=0, matrix_world_sizes=[2, 4])
    assert lanes == {CPU_WORLD_SIZE: [Lane(2, "gloo", None)]}
    assert set(skipped) == {4} and "--world-size 4" in skipped[4]
    lanes, skipped = plan_lanes([4], "gloo", n_gpus=8, matrix_world_sizes=[2, 4])
    assert lanes == {4: [Lane(4, "gloo", None)]} and skipped == {}


def test_gpus_are_split_into_disjoint_pools_per_world_size() -> None:
    lanes, skipped = plan_lanes(None, "auto", n_gpus=2, matrix_world_sizes=[2, 4])
    assert lanes == {2: [Lane(2, "nccl", (0, 1))]}
    assert "needs 4 GPUs" in skipped[4] and "2 visible" in skipped[4]

    lanes, skipped = plan_lanes(None, "auto", n_gpus=8, matrix_world_sizes=[2, 4])
    assert skipped == {}
    assert [lane.devices for lane in lanes[2]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [lane.devices for lane in lanes[4]] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # Five GPUs: two pools of two; the fifth GPU idles rather than joining a lopsided pool.
    lanes, _ = plan_lanes([2], "nccl", n_gpus=5, matrix_world_sizes=[2, 4])
    assert [lane.devices for lane in lanes[2]] == [(0, 1), (2, 3)]


def _nightly_dir(parent: Path, name: str, file: str = "results.csv") -> Path:
    d = parent / name
    d.mkdir(parents=True)
    (d / file).write_text("")
    return d


def test_the_previous_nightly_is_the_newest_earlier_sibling_with_results(tmp_path: Path) -> None:
    old = _nightly_dir(tmp_path, "2026-01-01")
    newest_earlier = _nightly_dir(tmp_path, "2026-01-05", "results.jsonl")  # killed before its report
    _nightly_dir(tmp_path, "2026-01-09")  # later than this nightly: never a baseline
    (tmp_path / "2026-01-07").mkdir()  # no results: not a nightly
    (tmp_path / "2026-01-08.txt").write_text("a file, not a nightly")
    out = tmp_path / "2026-01-08"
    assert find_previous(out) == newest_earlier
    assert find_previous(tmp_path / "2026-01-03") == old
    assert find_previous(tmp_path / "2025-12-31") is None
    assert find_previous(tmp_path / "missing-parent" / "2026-01-02") is None


def test_the_baseline_is_the_report_directory_or_its_raw_results(tmp_path: Path) -> None:
    with_report = _nightly_dir(tmp_path, "a")
    (with_report / "results.jsonl").write_text("")
    assert baseline_source(with_report) == with_report
    killed = _nightly_dir(tmp_path, "b", "results.jsonl")
    assert baseline_source(killed) == killed / "results.jsonl"
    assert baseline_source(killed / "results.jsonl") == killed / "results.jsonl"


def test_fuzz_totals_are_read_from_the_campaign_table() -> None:
    runs = [PropertyRun("test_a", 300, 1.5, "passed"), PropertyRun("test_b", 100, 0.5, "failed")]
    text = "pytest noise\n| total | not a table row\n" + report(runs, "nightly")
    assert parse_fuzz_totals(text) == {"examples": 400, "seconds": 2.0, "examples_per_s": 200.0}
    assert parse_fuzz_totals("ImportError: no module named hypothesis\n") is None


@pytest.mark.parametrize(
    ("verdicts", "fuzz_exit", "regressions", "pools_failed", "code", "mentions"),
    [
        ({"pass": 3, "unsupported": 1}, 0, 0, False, 0, []),
        ({"pass": 3}, None, 0, False, 0, []),  # fuzz skipped
        ({"pass": 3, "timeout": 1}, 0, 0, False, 1, ["timeout: 1"]),
        ({"pass": 3}, 1, 0, False, 1, ["fuzz campaign exited with status 1"]),
        ({"pass": 3}, 0, 2, False, 1, ["2 regression(s)"]),
        ({"pass": 3, "fail": 2}, 0, 0, True, 2, ["fail: 2", "could not start"]),
    ],
)
def test_exit_status(verdicts: dict, fuzz_exit: int | None, regressions: int, pools_failed: bool, code: int, mentions: list[str]) -> None:
    got, reasons = exit_status(verdicts, fuzz_exit, regressions, pools_failed)
    assert got == code
    assert all(any(m in r for r in reasons) for m in mentions), reasons
    assert bool(reasons) == (code != 0)


def test_config_rejects_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match="fuzz_max_examples"):
        NightlyConfig(out=Path("x"), fuzz_max_examples=0)
    with pytest.raises(ValueError, match="time_budget_s"):
        NightlyConfig(out=Path("x"), time_budget_s=-1)
    selection = NightlyConfig(out=Path("x"), engines=["builtin"], limit=3).selection()
    assert selection.matrix == "full" and selection.engines == ["builtin"] and selection.limit == 3
