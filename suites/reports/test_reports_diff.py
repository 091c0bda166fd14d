"""``reports.diff``: what regresses, the order changes are listed in, and the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_files import write_results
from synthetic_records import record

import reports
from harness.cases.case import CaseConfig
from reports.__main__ import main
from reports.diff import diff_frames
from reports.matrix import latest, records_frame


def frame(records):
    return latest(records_frame(records))[0]


C = [CaseConfig(steps=s) for s in range(1, 13)]  # twelve distinct cases of one cell


def kinds_and_whats(result) -> list[tuple[str, str, str]]:
    return [(c.kind, c.what, c.full_id) for c in result.changes]


def test_changes_are_ordered_regressions_first_worst_first() -> None:
    old = frame([
        record(C[0], "pass", 0.1), record(C[1], "pass", 0.1), record(C[2], "pass", 0.1),
        record(C[3], "pass", 0.1), record(C[4], "fail", 9.0), record(C[5], "pass", 0.1),
        record(C[6], "pass", 0.1), record(C[7], "fail", 3.0), record(C[8], "pass", 0.1),
        record(C[9], "pass", 0.02),
    ])
    new = frame([
        record(C[0], "pass", 0.5),           # ratio x5: regression, listed after verdict regressions
        record(C[1], "fail", 4.0),           # pass -> fail
        record(C[2], "crash", None),         # new crash: worst
        record(C[3], "timeout", None),       # new timeout
        record(C[4], "pass", 0.2),           # fix
        record(C[5], "error", None),         # pass -> error
        record(C[6], "unsupported", None),   # coverage lost
        record(C[7], "error", None),         # fail -> error: other change
        # C[8] removed
        record(C[9], "pass", 0.03),          # x1.5: not a change
        record(C[10], "fail", 2.0),          # new case that fails: new, not a regression
        record(C[11], "timeout", None),      # new case that hangs: regression
    ])
    result = diff_frames(old, new)
    got = [(c.kind, c.what) for c in result.changes]
    assert got == [
        ("regression", "new crash (was pass)"),
        ("regression", "new timeout (was pass)"),
        ("regression", "new timeout (new case)"),
        ("regression", "pass → error"),
        ("regression", "pass → fail"),
        ("regression", "pass → unsupported"),
        ("regression", "ratio ×5 (0.1 → 0.5)"),
        ("fix", "fail → pass"),
        ("new", "new case, fail"),
        ("removed", "removed (was pass)"),
        ("changed", "fail → error"),
    ]
    assert [c.full_id for c in result.changes][:3] == [C[2].full_id, C[3].full_id, C[11].full_id]
    assert result.exit_code == 1
    assert result.new_cells == []  # every case is in the one cell both sides have


@pytest.mark.parametrize(
    ("old_ratio", "new_ratio", "regressed"),
    [
        (0.1, 0.21, True),    # more than 2x and above the floor
        (0.1, 0.19, False),   # less than 2x
        (0.001, 0.01, False),  # 10x but far below tolerance: noise
        (0.0, 0.3, True),     # bitwise equal before, drifted now
        (2.0, 5.0, True),     # a failing case failing worse
    ],
)
def test_error_ratio_growth(old_ratio: float, new_ratio: float, regressed: bool) -> None:
    verdict = "fail" if old_ratio > 1 else "pass"
    result = diff_frames(frame([record(C[0], verdict, old_ratio)]),
                         frame([record(C[0], "fail" if new_ratio > 1 else "pass", new_ratio)]))
    assert bool(result.regressions) is regressed
    assert result.exit_code == int(regressed)


def test_ratio_thresholds_are_parameters() -> None:
    old, new = frame([record(C[0], "pass", 0.1)]), frame([record(C[0], "pass", 0.16)])
    assert not diff_frames(old, new).regressions
    assert diff_frames(old, new, ratio_factor=1.5).regressions
    with pytest.raises(ValueError, match="ratio_factor"):
        diff_frames(old, new, ratio_factor=0.5)


def test_fixes_and_new_cells_alone_exit_zero() -> None:
    old = frame([record(C[0], "fail", 3.0)])
    new = frame([record(C[0], "pass", 0.2), record(CaseConfig(precision="bf16"), "fail", 9.0)])
    result = diff_frames(old, new)
    assert [c.kind for c in result.changes] == ["fix", "new"]
    assert result.new_cells == ["torch-fsdp vs ddp · nested · full_shard · bf16 · bwd none"]
    assert result.exit_code == 0


def test_identical_results_have_no_changes(tmp_path: Path) -> None:
    records = [record(c, "pass", 0.1 * i) for i, c in enumerate(C)]
    result = reports.diff(write_results(tmp_path / "a.jsonl", records), write_results(tmp_path / "b.jsonl", records))
    assert result.changes == [] and result.exit_code == 0


def test_cli_diff_report_dir_against_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = write_results(tmp_path / "old.jsonl", [record(C[0], "fail", 3.0), record(C[1], "pass", 0.1)])
    reports.build(old, tmp_path / "old_report")
    new = write_results(tmp_path / "new.jsonl", [record(C[0], "pass", 0.1), record(C[1], "fail", 7.0)])
    with open(new, "a") as f:
        f.write('{"case": {"engine": "builtin"')  # a cut line on the new side is reported
    code = main(["diff", str(tmp_path / "old_report"), str(new), "--json", str(tmp_path / "d.json"),
                 "--md", str(tmp_path / "d.md")])
    out = capsys.readouterr().out
    assert code == 1
    assert out.index("## Regressions") < out.index("## Fixes")
    assert "1 unreadable result line" in out
    assert (tmp_path / "d.md").read_text() == out
    written = json.loads((tmp_path / "d.json").read_text())
    assert written["exit_code"] == 1 and written["counts"]["regression"] == 1 and len(written["bad_lines"]) == 1
    assert [c["what"] for c in written["changes"]] == ["pass → fail", "fail → pass"]


def test_cli_diff_without_regressions_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = write_results(tmp_path / "old.jsonl", [record(C[0], "fail", 3.0)])
    new = write_results(tmp_path / "new.jsonl", [record(C[0], "pass", 0.1)])
    assert main(["diff", str(old), str(new)]) == 0
    assert "✅ Parity diff: 0 regression(s), 0 new failing case(s), 1 fix(es)" in capsys.readouterr().out
    assert main(["diff", str(old), str(tmp_path / "nope")]) == 2


def test_a_flaky_case_is_a_regression_after_a_pass_and_no_fix_before_one() -> None:
    old = frame([record(C[0], "pass", 0.1), record(C[1], "flaky", 3.0), record(C[2], "fail", 3.0)])
    new = frame([record(C[0], "flaky", 3.0), record(C[1], "pass", 0.1), record(C[2], "flaky", 3.0)])
    result = diff_frames(old, new)
    assert kinds_and_whats(result) == [
        ("regression", "pass → flaky", f"torch-fsdp:ddp:{C[0].case_id}"),
        ("changed", "fail → flaky", f"torch-fsdp:ddp:{C[2].case_id}"),
        ("changed", "flaky → pass", f"torch-fsdp:ddp:{C[1].case_id}"),
    ]
    assert result.exit_code == 1


def test_flaky_cases_are_counted_and_coloured_in_the_report(tmp_path: Path) -> None:
    from reports.matrix import CellStats
    from reports.render import STATUS_COLOURS, cell_colour

    stats = CellStats.of(frame([record(C[0], "pass", 0.1), record(C[1], "flaky", 3.0)]))
    assert stats.status == "flaky" and stats.total == 2 and stats.flaky == 1
    assert cell_colour(stats) == STATUS_COLOURS["flaky"]
    assert CellStats.of(frame([record(C[0], "fail", 3.0), record(C[1], "flaky", 3.0)])).status == "fail"
    results = write_results(tmp_path / "r.jsonl", [record(C[0], "pass", 0.1), record(C[1], "flaky", 3.0)])
    summary = reports.build([results], tmp_path / "report")
    assert summary.verdicts["flaky"] == 1 and not summary.ok
    assert "flaky: 1" in (tmp_path / "report" / "matrix.md").read_text()


def test_new_failing_cases_do_not_block_but_the_headline_counts_them_and_is_not_green(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = write_results(tmp_path / "old.jsonl", [record(C[0], "pass", 0.1)])
    new = write_results(tmp_path / "new.jsonl", [record(C[0], "pass", 0.1), record(C[1], "fail", 9.0),
                                                 record(C[2], "error", None), record(C[3], "pass", 0.1)])
    assert main(["diff", str(old), str(new)]) == 0  # a new case does not block the change adding it
    out = capsys.readouterr().out
    assert out.startswith("# ⚠️ Parity diff: 0 regression(s), 2 new failing case(s), 0 fix(es)")
    assert "✅" not in out
    result = reports.diff(old, new)
    assert sorted(c.full_id for c in result.new_failing) == sorted([C[1].full_id, C[2].full_id])
    assert result.to_dict()["new_failing"] == 2


def test_cases_a_budget_left_out_are_not_run_not_removed() -> None:
    old = frame([record(c, "pass", 0.1) for c in C[:4]])
    new = frame([record(C[0], "pass", 0.1)])
    result = diff_frames(old, new, not_run={C[1].full_id, C[2].full_id})
    assert sorted((c.kind, c.full_id) for c in result.changes) == sorted(
        [("not_run", C[1].full_id), ("not_run", C[2].full_id), ("removed", C[3].full_id)])
    assert result.exit_code == 0 and result.to_dict()["counts"]["not_run"] == 2


def test_results_with_no_case_in_common_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="no case in common"):
        diff_frames(frame([record(C[0], "pass", 0.1)]), frame([record(C[1], "pass", 0.1)]))
    old = write_results(tmp_path / "old.jsonl", [record(C[0], "pass", 0.1)])
    new = write_results(tmp_path / "new.jsonl", [record(C[1], "fail", 3.0)])
    assert main(["diff", str(old), str(new)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no case in common" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["diff", "OLD", "NEW", "--md", "/proc/x.md"], "--md: /proc/x.md is under /proc"),
    (["diff", "OLD", "NEW", "--json", "/proc/x.json"], "--json: /proc/x.json is under /proc"),
    (["build", "NEW", "--out", "FILE"], "is a file; the report is a directory"),
    (["diff", "OLD"], "the following arguments are required: new (--help for usage)"),
    (["build", "NEW", "--out", "DIR", "--bogus"], "unrecognized arguments: --bogus (--help for usage)"),
])
def test_an_output_or_option_that_cannot_work_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    old = write_results(tmp_path / "old.jsonl", [record(C[0], "pass", 0.1)])
    new = write_results(tmp_path / "new.jsonl", [record(C[0], "fail", 3.0)])
    (tmp_path / "file").write_text("not a report directory\n")
    paths = {"OLD": str(old), "NEW": str(new), "FILE": str(tmp_path / "file"), "DIR": str(tmp_path / "report")}
    argv = [paths.get(a, a) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "usage:" not in err
    assert (tmp_path / "file").read_text() == "not a report directory\n"


def test_an_expected_failure_is_never_a_regression_and_an_expected_pass_is_a_visible_fix() -> None:
    known = "a known engine bug"
    old = frame([record(C[0], "pass", 0.1), record(C[1], "error", None, expected_failure=known),
                 record(C[2], "pass", 0.1)])
    new = frame([
        record(C[0], "crash", None, expected_failure=known),  # now expected to fail, and failing
        record(C[1], "pass", 0.1, expected_failure=known),     # the bug went away
        record(C[2], "fail", 5.0),                              # breakage
        record(C[3], "timeout", None, expected_failure=known),  # a new case, failing as expected
    ])
    result = diff_frames(old, new)
    assert kinds_and_whats(result) == [
        ("regression", "pass → fail", C[2].full_id),
        ("fix", "error → pass (was expected to fail)", C[1].full_id),
        ("new", "new case, timeout (expected)", C[3].full_id),
        ("changed", "pass → crash (expected)", C[0].full_id),
    ]
    assert result.new_failing == [] and result.exit_code == 1
    assert diff_frames(old, new[new["full_id"] != C[2].full_id]).exit_code == 0


def test_a_case_lost_to_an_unreadable_line_never_leaves_the_headline_green(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = write_results(tmp_path / "old.jsonl", [record(C[0], "pass", 0.1), record(C[1], "pass", 0.1)])
    new = write_results(tmp_path / "new.jsonl", [record(C[0], "pass", 0.1)])
    with open(new, "a") as f:
        f.write(json.dumps(record(C[1], "fail", 9.0).to_dict())[:80])  # the regression, cut by a kill
    main(["diff", str(old), str(new)])
    out = capsys.readouterr().out
    assert out.startswith("# ⚠️ Parity diff: 0 regression(s), 0 new failing case(s), 0 fix(es), "
                          "1 unreadable line(s) not compared") and "✅" not in out
