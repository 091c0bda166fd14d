"""The nightly's pure logic: which pools run, which earlier nightly is the baseline, the fuzz totals
and the exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.cli.fuzz import REPORT_RESERVE_S, fuzz_alongside, fuzz_budget, parse_fuzz_totals
from harness.cli.night import baseline_source, determinism_sample, determinism_summary, exit_status, find_previous
from harness.cli.nightly import NightlyConfig
from harness.conformance.fuzz_campaign import PropertyRun, report
from harness.ranks.placement import CPU_WORLD_SIZE, HostFacts, Lane, plan_lanes, pools_per_group
from harness.run.runner import Selection, SelectionError, select_cases


def test_cpu_runs_one_gloo_pool_of_two_ranks_and_says_what_it_leaves_out() -> None:
    lanes, skipped = plan_lanes(None, "auto", n_gpus=0, matrix_world_sizes=[2, 4])
    assert lanes == {CPU_WORLD_SIZE: [Lane(2, "gloo", None)]}
    assert set(skipped) == {4} and "--world-size 4" in skipped[4]
    lanes, skipped = plan_lanes([4], "gloo", n_gpus=8, matrix_world_sizes=[2, 4], device="cpu")
    assert lanes == {4: [Lane(4, "gloo", None)]} and skipped == {}
    # gloo alone is not "on the CPU": with GPUs it runs on them.
    lanes, _ = plan_lanes([4], "gloo", n_gpus=8, matrix_world_sizes=[2, 4])
    assert lanes == {4: [Lane(4, "gloo", (0, 1, 2, 3)), Lane(4, "gloo", (4, 5, 6, 7))]}


def test_gpus_are_split_into_disjoint_pools_per_world_size() -> None:
    lanes, skipped = plan_lanes(None, "auto", n_gpus=2, matrix_world_sizes=[2, 4])
    assert lanes == {2: [Lane(2, "nccl", (0, 1))]}
    assert "--world-size 4" in skipped[4] and "2 GPU(s)" in skipped[4]

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


def test_the_previous_nightly_is_the_newest_earlier_sibling_holding_a_nightly_json(tmp_path: Path) -> None:
    old = _nightly_dir(tmp_path, "2026-01-01", "nightly.json")
    newest_earlier = _nightly_dir(tmp_path, "2026-01-05", "nightly.json")  # killed before its report
    (newest_earlier / "results.jsonl").write_text("")
    _nightly_dir(tmp_path, "2026-01-09", "nightly.json")  # later than this nightly: never a baseline
    (tmp_path / "2026-01-07").mkdir()  # nothing in it: not a nightly
    _nightly_dir(tmp_path, "2026-01-06", "results.csv")  # a report of `harness run`, not a nightly
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
        ({"pass": 3, "flaky": 1}, 0, 0, False, 1, ["flaky: 1"]),  # failed in some runs: bad
        ({}, None, 0, False, 1, ["no case was run"]),  # an empty nightly (a budget of 0 s) is never green
        ({"pass": 0}, 0, 0, False, 1, ["no case was run"]),
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
    assert NightlyConfig(out=Path("x")).selection == Selection(matrix="full")


GIB = 1 << 30


def test_pools_per_group_follow_cores_and_gpu_memory() -> None:
    two, four = Lane(2, "nccl", (0, 1)), Lane(4, "nccl", (0, 1, 2, 3))
    # 2 x H200 (141 GB) with 32 cores: capped by MAX_POOLS_PER_GROUP; 16 cores: by the cores.
    assert pools_per_group(two, 1, HostFacts(cpu_cores=32, gpu_memory_bytes=141 * GIB)) == 8
    assert pools_per_group(two, 1, HostFacts(cpu_cores=16, gpu_memory_bytes=80 * GIB)) == 6
    # Small GPUs: by the memory; 8 GPUs in 4 groups share the cores.
    assert pools_per_group(two, 1, HostFacts(cpu_cores=64, gpu_memory_bytes=12 * GIB)) == 3
    assert pools_per_group(two, 4, HostFacts(cpu_cores=19, gpu_memory_bytes=80 * GIB)) == 2
    # Never none; CPU pools need two cores per rank.
    assert pools_per_group(four, 1, HostFacts(cpu_cores=2, gpu_memory_bytes=1 * GIB)) == 1
    assert pools_per_group(Lane(2, "gloo", None), 1, HostFacts(cpu_cores=2)) == 1
    assert pools_per_group(Lane(2, "gloo", None), 1, HostFacts(cpu_cores=16)) == 4
    with pytest.raises(ValueError, match="world_size"):
        pools_per_group(Lane(0, "nccl", None), 1, HostFacts(cpu_cores=8))


def test_pools_of_ranks_sharing_a_gpu_budget_its_memory_and_the_hosts() -> None:
    # One 80 GB GPU, 16 cores: 2 ranks on it per pool take 8 GiB of it: cores allow 6 pools.
    shared2, shared8 = Lane(2, "gloo", (0, 0)), Lane(8, "gloo", (0,) * 8)
    assert pools_per_group(shared2, 1, HostFacts(cpu_cores=16, gpu_memory_bytes=80 * GIB)) == 6
    # 8 ranks on one GPU: 32 GiB a pool, so 2 fit; 16 cores allow only 1.
    assert pools_per_group(shared8, 1, HostFacts(cpu_cores=64, gpu_memory_bytes=80 * GIB)) == 2
    assert pools_per_group(shared8, 1, HostFacts(cpu_cores=16, gpu_memory_bytes=80 * GIB)) == 1
    # Host memory: 2 GiB per CUDA rank.
    assert pools_per_group(shared2, 1, HostFacts(cpu_cores=64, gpu_memory_bytes=141 * GIB, host_memory_bytes=12 * GIB)) == 3


def test_lanes_put_several_pools_on_each_gpu_group() -> None:
    host = HostFacts(cpu_cores=32, gpu_memory_bytes=141 * GIB)
    lanes, _ = plan_lanes(None, "auto", n_gpus=2, matrix_world_sizes=[2, 4], host=host)
    assert lanes[2] == [Lane(2, "nccl", (0, 1))] * 8
    lanes, _ = plan_lanes([2], "nccl", n_gpus=4, matrix_world_sizes=[2, 4], pools=2)
    # Group by group: the first lanes already cover every GPU.
    assert [lane.devices for lane in lanes[2]] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    lanes, _ = plan_lanes(None, "auto", n_gpus=0, matrix_world_sizes=[2, 4], pools=2)
    assert lanes == {2: [Lane(2, "gloo", None)] * 2}
    # One GPU: the nightly's 2 ranks share it through gloo, pools side by side spread over the GPUs.
    lanes, skipped = plan_lanes(None, "auto", n_gpus=1, matrix_world_sizes=[2, 4], pools=3)
    assert lanes == {2: [Lane(2, "gloo", (0, 0))] * 3} and "--world-size 4" in skipped[4]
    lanes, _ = plan_lanes([4], "auto", n_gpus=2, matrix_world_sizes=[2, 4], pools=2)
    assert [lane.devices for lane in lanes[4]] == [(0, 1, 0, 1), (0, 1, 0, 1)]
    lanes, _ = plan_lanes([3], "auto", n_gpus=2, matrix_world_sizes=[2, 4], pools=2)
    assert [lane.devices for lane in lanes[3]] == [(0, 1, 0), (1, 0, 1)]
    with pytest.raises(ValueError, match="pools-per-gpu"):
        plan_lanes(None, "auto", n_gpus=0, matrix_world_sizes=[2], pools=0)


def test_determinism_is_checked_on_one_case_per_engine_strategy_and_world_size() -> None:
    cases = select_cases(Selection(matrix="pairwise"), [2, 4])
    sampled = determinism_sample(cases)
    assert [c.full_id for c in sampled] == [c.full_id for c in cases]  # same cases, same ids
    checked = [c for c in sampled if c.check_determinism]
    keys = {(c.engine, c.sharding_strategy, c.world_size) for c in cases}
    assert len(checked) == len(keys) and {(c.engine, c.sharding_strategy, c.world_size) for c in checked} == keys
    assert determinism_sample(sampled) == sampled


def test_determinism_summary_names_nondeterministic_configurations() -> None:
    def record(engine: str, strategy: str, deterministic: bool | None) -> CaseRecord:
        case = CaseConfig(engine=engine, sharding_strategy=strategy)  # type: ignore[arg-type]
        return CaseRecord(case.to_dict(), case.case_id, "pass" if deterministic is not False else "fail",
                          deterministic=deterministic)

    got = determinism_summary([record("builtin", "full_shard", True), record("torch-fsdp2", "full_shard", False),
                               record("torch-fsdp2", "full_shard", True), record("builtin", "no_shard", None)])
    assert got["nondeterministic"] == ["torch-fsdp2/full_shard"]
    assert got["configurations"]["torch-fsdp2/full_shard"]["checked"] == 2
    assert got["configurations"]["builtin/full_shard"] == {"checked": 1, "nondeterministic": []}
    assert "builtin/no_shard" not in got["configurations"]


def test_the_fuzz_gets_what_the_budget_leaves() -> None:
    assert fuzz_budget(None, 1e6) is None
    assert fuzz_budget(600, 100) == 600 - 100 - REPORT_RESERVE_S
    assert fuzz_budget(600, 590) == 0.0


def test_the_budget_keeps_the_report_s_reserve_from_the_cases() -> None:
    from harness.cli.fuzz import cases_deadline, report_reserve

    assert cases_deadline(1000.0, None) is None
    assert cases_deadline(1000.0, 600.0) == 1000.0 + 600 - REPORT_RESERVE_S
    # A short budget keeps a quarter for the report: 60 s must not end at 100 s.
    assert report_reserve(60.0) == 15.0 and cases_deadline(0.0, 60.0) == 45.0
    assert fuzz_budget(60, 40) == 60 - 40 - 15.0
    assert cases_deadline(0.0, 0.0) == 0.0


def test_the_fuzz_runs_alongside_gpu_cases_where_cores_are_left() -> None:
    eight = {2: [Lane(2, "nccl", (0, 1))] * 8}
    assert fuzz_alongside(eight, cpu_cores=32)  # 16 ranks, 16 cores left
    assert not fuzz_alongside(eight, cpu_cores=18)  # 2 cores left: too few
    assert not fuzz_alongside({2: [Lane(2, "gloo", None)]}, cpu_cores=64)  # CPU ranks take every core
    assert fuzz_alongside({2: [Lane(2, "gloo", (0, 0))] * 4}, cpu_cores=16)  # ranks sharing a GPU leave cores
    # World sizes run one after the other: the widest one counts.
    assert fuzz_alongside({2: [Lane(2, "nccl", (0, 1))] * 4, 4: [Lane(4, "nccl", (0, 1, 2, 3))] * 2}, cpu_cores=11)


def test_a_resumed_nightly_takes_back_its_selection_and_budget_unless_given_again() -> None:
    from harness.cli.nightly_config import resumed_config
    from harness.run.stored_selection import selection_options

    first = NightlyConfig(out=Path("n"), selection=Selection(matrix="full", engines=["builtin", "toy-buggy"]),
                          time_budget_s=60.0, fuzz_profile="none")
    stored = selection_options(first.selection, [2])
    earlier = first.to_dict()
    # The printed resume line: --out and --resume, every other option at its default.
    plain = NightlyConfig(out=Path("n"), resume=True)
    back = resumed_config(plain, stored, earlier, explicit=())
    assert back.selection == first.selection and back.world_sizes == [2]
    assert back.time_budget_s == 60.0 and back.fuzz_profile == "none" and back.resume
    # An option given again wins over the earlier attempt's; a selection option must agree.
    longer = resumed_config(NightlyConfig(out=Path("n"), time_budget_s=600.0), stored, earlier, explicit={"time_budget_s"})
    assert longer.time_budget_s == 600.0
    with pytest.raises(SelectionError, match=r"--engines builtin \(the file's: builtin,toy-buggy\)"):
        resumed_config(NightlyConfig(out=Path("n"), selection=Selection(matrix="full", engines=["builtin"])), stored,
                       earlier, explicit={"engines"})
    same = resumed_config(NightlyConfig(out=Path("n"), selection=first.selection), stored, earlier, explicit={"engines"})
    assert same.selection == first.selection
    # A nightly from before selections were stored keeps the options given now.
    assert resumed_config(plain, None, {}, explicit=()).selection == plain.selection


def test_a_partial_nightly_never_reads_as_ok() -> None:
    from harness.cli.night import partial_reasons

    whole = {"cases": {"selected": 5, "not_run": 0}, "fuzz": {"skipped": "--fuzz-profile none"}, "perf": {"skipped": "--no-perf"}}
    assert partial_reasons(whole) == []
    trial = {"cases": {"selected": 451, "not_run": 40}, "fuzz": {"skipped": "time budget of 120 s spent by the cases"},
             "perf": {"skipped": "time budget of 120 s spent"}}
    assert partial_reasons(trial) == ["40 of 451 cases not run", "fuzz skipped (time budget of 120 s spent by the cases)",
                                      "perf skipped (time budget of 120 s spent)"]
