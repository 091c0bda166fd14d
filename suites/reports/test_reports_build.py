"""``reports.build``: tables, every output, cut results files, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
from report_files import write_results
from synthetic_records import RUN, mixed_records, record

import reports
from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.collect.collector import read_records
from reports.__main__ import main
from reports.case_page import case_href, case_slug
from reports.matrix import CellStats, cell_label, latest, marginals, parity_matrices, records_frame, summarize

REPO = Path(__file__).resolve().parents[2]


def cell_cases(n: int, **axes) -> list[CaseConfig]:
    """``n`` distinct cases of one matrix cell (they differ in axes a cell aggregates over)."""
    variants = [dict(forward_prefetch=f, use_orig_params=o, init_mode=i)
                for i in ("before", "never") for f in (False, True) for o in (False, True)]
    return [CaseConfig(**axes, **variants[k]) for k in range(n)]


# --- tables ------------------------------------------------------------------------------------------


def test_a_cell_counts_passes_over_cases_that_ran_and_keeps_the_worst_ratio() -> None:
    a, b, c, d, e = cell_cases(5, precision="bf16")
    frame = records_frame([
        record(a, "pass", 0.2), record(b, "pass", 0.7), record(c, "fail", 12.0),
        record(d, "unsupported", None), record(e, "pass", None),
    ])
    (m,) = parity_matrices(frame)
    stats = m.cell("full_shard", "bf16", "none")
    assert (stats.passed, stats.failed, stats.total, stats.unsupported) == (3, 1, 4, 1)
    assert stats.worst_ratio == 12.0 and stats.status == "fail"
    assert cell_label(stats) == "3/4 · 12 +1u"
    assert m.cell("no_shard", "bf16", "none").status == "empty"


@pytest.mark.parametrize(
    ("verdicts", "status", "label"),
    [
        (["pass", "fail", "timeout"], "error", "1/3 · timeout"),
        (["crash", "error"], "error", "0/2 · crash"),
        (["unsupported", "unsupported"], "unsupported", "unsupported (2)"),
        (["pass", "pass"], "pass", "2/2 · 0.5"),
    ],
)
def test_cell_status_takes_the_worst_verdict(verdicts: list[str], status: str, label: str) -> None:
    cases = cell_cases(len(verdicts))
    frame = records_frame([record(c, v, 0.5 if v in ("pass", "fail") else None) for c, v in zip(cases, verdicts)])
    stats = CellStats.of(frame)
    assert stats.status == status
    assert cell_label(stats) == label


def test_matrices_split_by_engine_reference_and_model_in_display_order() -> None:
    records = [
        record(CaseConfig(engine=e, reference=r, model=mo, use_orig_params=True, backward_prefetch="pre"))
        for mo in ("transformer", "nested") for r in ("local", "ddp") for e in ("torch-fsdp2", "builtin")
    ]
    titles = [m.title for m in parity_matrices(records_frame(records))]
    assert titles == [
        "builtin vs ddp · nested", "builtin vs ddp · transformer", "builtin vs local · nested",
        "builtin vs local · transformer", "torch-fsdp2 vs ddp · nested", "torch-fsdp2 vs ddp · transformer",
        "torch-fsdp2 vs local · nested", "torch-fsdp2 vs local · transformer",
    ]


def test_matrix_table_has_strategy_rows_and_precision_by_prefetch_columns() -> None:
    records = [
        record(CaseConfig(sharding_strategy=s, precision=p, backward_prefetch=b))
        for s in ("no_shard", "full_shard") for p in ("fp16", "fp32") for b in ("post", "none")
    ]
    (m,) = parity_matrices(records_frame(records))
    table = m.table()
    assert list(table.index) == ["full_shard", "no_shard"]
    assert list(table.columns) == [("fp32", "none"), ("fp32", "post"), ("fp16", "none"), ("fp16", "post")]
    assert table.loc["no_shard", ("fp16", "post")] == "1/1 · 0.2"


def test_marginals_show_a_failure_shared_by_one_axis_value() -> None:
    records = [
        record(CaseConfig(engine=e, cpu_offload=off, precision=p), "fail" if off else "pass", 3.0 if off else 0.1)
        for e in ("builtin", "torch-fsdp") for off in (False, True) for p in ("fp32", "bf16")
    ]
    tables = marginals(records_frame(records))
    offload = tables["cpu_offload"]
    assert offload.loc[True, "builtin"] == "0/2" and offload.loc[False, "torch-fsdp"] == "2/2"
    assert offload.loc[True, "worst ratio"] == "3"
    assert "engine" not in tables and "model" not in tables, "single-valued axes say nothing"


def test_latest_record_of_a_case_wins() -> None:
    case = CaseConfig()
    frame = records_frame([record(case, "fail", 5.0, time=2.0), record(case, "pass", 0.1, time=3.0),
                           record(CaseConfig(steps=2), time=1.0)])
    kept, superseded = latest(frame)
    assert superseded == 1
    assert kept.set_index("full_id").loc[case.full_id, "verdict"] == "pass"


# --- outputs -----------------------------------------------------------------------------------------


def test_build_writes_every_output(built) -> None:
    mixed_results, out, summary = built
    records, _ = read_records(mixed_results)
    engines = sorted({r.case["engine"] for r in records})
    assert len(summary.matrices) == len(engines)
    pngs = sorted(p.name for p in out.glob("heatmap_*.png"))
    assert pngs == sorted(m.heatmap for m in summary.matrices)
    for name in pngs:
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 400
    pages = {f"cases/{case_slug(r.case['engine'] + ':' + r.case['reference'] + ':' + r.case_id)}.html"
             for r in records if r.verdict != "pass"}
    case_pngs = {f for f in summary.files if f.startswith("cases/") and f.endswith(".png")}
    assert set(summary.files) == {"matrix.md", "matrix.html", "results.csv", "summary.json", *pngs, *pages, *case_pngs}
    assert all((out / f).stat().st_size > 0 for f in summary.files)

    assert summary.cases == len(records)
    for verdict in ("pass", "fail", "timeout", "crash", "error", "unsupported"):
        assert summary.verdicts[verdict] == sum(r.verdict == verdict for r in records), verdict
    assert not summary.ok

    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["verdicts"] == summary.verdicts and on_disk["ok"] is False
    assert [m["heatmap"] for m in on_disk["matrices"]] == [m.heatmap for m in summary.matrices]

    csv = pd.read_csv(out / "results.csv")
    assert sorted(csv["full_id"]) == sorted(f"{r.case['engine']}:{r.case['reference']}:{r.case_id}" for r in records)

    md = (out / "matrix.md").read_text()
    for m in summary.matrices:
        assert f"## {m.engine} vs {m.reference} · {m.model}" in md
    html = (out / "matrix.html").read_text()
    # Self-contained: one inline script (the filters), nothing fetched from elsewhere.
    assert html.startswith("<!DOCTYPE html>") and html.count("<script") == 1 and "http" not in html
    assert "<script src" not in html


def test_a_failing_cell_opens_its_failing_cases_in_html(tmp_path: Path) -> None:
    bad, good = cell_cases(2, precision="fp16")
    results = write_results(tmp_path / "r.jsonl", [
        record(bad, "fail", 40.0, reason="grad mismatch <script>alert(1)</script>"),
        record(good, "pass", 0.1),
        record(CaseConfig(sharding_strategy="no_shard"), "pass", 0.1),
    ])
    reports.build(results, tmp_path / "out")
    html = (tmp_path / "out" / "matrix.html").read_text()
    assert html.count("<details>") == 1
    assert f"<code>{bad.case_id}</code>" in html and f"<code>{good.case_id}</code>" not in html
    assert f'href="{case_href(bad.full_id)}"' in html, "a failing cell links to its case page"
    assert "&lt;script&gt;" in html and "<script>alert" not in html


def test_cut_results_file_still_builds_and_reports_the_cut_record(small_results: Path, tmp_path: Path) -> None:
    records, _ = read_records(small_results)
    cut = json.dumps(record(CaseConfig(steps=7), "pass").to_dict())[:57]
    with open(small_results, "a") as f:
        f.write(cut)  # a run killed in the middle of writing its last record
    summary = reports.build(small_results, tmp_path / "out")
    assert summary.cases == len(records)
    (bad,) = summary.bad_lines
    assert bad.line == len(records) + 1 and bad.head == cut
    out = tmp_path / "out"
    for name in ("matrix.md", "matrix.html"):
        text = (out / name).read_text()
        assert "1 unreadable result line" in text and f"{bad.line}" in text, name
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["bad_lines"] == [bad.to_dict()]


def test_report_directory_reads_back_like_its_results(built) -> None:
    mixed_results, out, _ = built
    from_file = reports.load(mixed_results).frame.set_index("full_id").sort_index()
    from_dir = reports.load(out).frame.set_index("full_id").sort_index()
    key = ["engine", "precision", "cpu_offload", "world_size", "verdict", "reason"]
    pd.testing.assert_frame_equal(from_file[key], from_dir[key])
    assert all(
        (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)
        for a, b in zip(from_file["worst_ratio"], from_dir["worst_ratio"])
    )


def test_rebuild_drops_heatmaps_of_matrices_that_are_gone(tmp_path: Path) -> None:
    out = tmp_path / "out"
    reports.build(write_results(tmp_path / "a.jsonl", [record(CaseConfig(engine="builtin"))]), out)
    reports.build(write_results(tmp_path / "b.jsonl", [record(CaseConfig(engine="torch-fsdp"))]), out)
    assert [p.name for p in out.glob("heatmap_*.png")] == ["heatmap_torch-fsdp_vs_ddp_nested.png"]


def test_empty_results_build_an_empty_report(tmp_path: Path) -> None:
    (tmp_path / "r.jsonl").write_text("")
    summary = reports.build(tmp_path / "r.jsonl", tmp_path / "out")
    assert summary.cases == 0 and summary.matrices == [] and summary.ok
    assert "no cases" in (tmp_path / "out" / "matrix.md").read_text()


def test_cli_build_in_process(small_results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", str(small_results), "--out", str(tmp_path / "out")]) == 0
    assert "matrix.md" in capsys.readouterr().out
    assert main(["build", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_python_dash_m_reports_build(tmp_path: Path) -> None:
    results = write_results(tmp_path / "one.jsonl", [record(CaseConfig())])
    proc = subprocess.run(
        [sys.executable, "-m", "reports", "build", str(results), "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "matrix.html").exists()


def test_run_info_reaches_the_report(built) -> None:
    _, out, summary = built
    assert summary.runs == [{**RUN.__dict__}]
    assert f"run `{RUN.run_id}`" in (out / "matrix.md").read_text()


def test_mixed_records_cover_every_cell_status() -> None:
    """The synthetic data the build tests use exercises every colour of the report."""
    frame = records_frame(mixed_records())
    statuses = {stats.status for m in parity_matrices(frame) for stats in m.cells.values()}
    assert statuses == {"pass", "fail", "error", "unsupported"}


def test_the_report_header_says_backend_device_and_ranks_per_gpu() -> None:
    from harness.cases.records import placement_text
    from reports.matrix import Summary
    from reports.render import run_lines

    assert placement_text("gloo", "cuda", 2) == "gloo on cuda, 2 ranks per GPU"
    assert placement_text("nccl", "cuda", 1) == "nccl on cuda, one GPU per rank"
    assert placement_text("gloo", None, float("nan")) == "gloo on cpu"  # a record from before the fields
    summary = Summary.__new__(Summary)
    summary.runs = [{"run_id": "r", "backend": "gloo", "device": "cuda", "ranks_per_gpu": 2, "torch_version": "2.11"}]
    assert "gloo on cuda, 2 ranks per GPU" in run_lines(summary)[0]


def test_heatmap_column_labels_never_overlap() -> None:
    from harness.cases.case import PRECISIONS
    from reports.matrix import parity_matrices, records_frame
    from reports.render import heatmap_figure

    # One prefetch per precision: a column of 0.78 in under each long precision name.
    records = [record(CaseConfig(engine="builtin", precision=p), "pass", 0.1) for p in PRECISIONS]
    [matrix] = parity_matrices(records_frame(records))
    fig = heatmap_figure(matrix)
    renderer = fig.canvas.get_renderer()
    for axis in (fig.axes[0].xaxis, *(child.xaxis for child in fig.axes[0].child_axes)):
        boxes = sorted((t.get_window_extent(renderer) for t in axis.get_ticklabels() if t.get_text()), key=lambda b: b.x0)
        assert boxes and all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in axis.get_ticklabels()]


# --- expected failures -------------------------------------------------------------------------------

KNOWN = "torch FSDP1's LOCAL_STATE_DICT under hybrid sharding is broken"


def test_expected_failures_are_counted_apart_and_do_not_fail_the_cell() -> None:
    a, b, c, d = cell_cases(4)
    frame = records_frame([record(a, "pass", 0.5), record(b, "pass", 0.5), record(d, "unsupported", None),
                           record(c, "error", None, expected_failure=KNOWN)])
    stats = CellStats.of(frame)
    assert (stats.passed, stats.errored, stats.expected, stats.total, stats.status) == (2, 0, 1, 2, "pass")
    assert cell_label(stats) == "2/2 · 0.5 +1x +1u"
    # Only expected failures ran: a state of its own, neither a pass nor breakage.
    only = CellStats.of(records_frame([record(c, "error", None, expected_failure=KNOWN)]))
    assert (only.status, only.worst_verdict, cell_label(only)) == ("expected", "error", "expected failure (1)")
    # The same failure without the expectation is breakage; a pass carrying it is a plain pass.
    assert CellStats.of(records_frame([record(a, "pass", 0.5), record(c, "error", None)])).status == "error"
    assert CellStats.of(records_frame([record(a, "pass", 0.5, expected_failure=KNOWN)])).status == "pass"


def test_a_record_written_before_expected_failure_reads_as_expecting_a_pass() -> None:
    old = record(CaseConfig(), "fail", 3.0).to_dict()
    del old["expected_failure"]
    assert CaseRecord.from_dict(old).expected_failure is None
    assert records_frame([CaseRecord.from_dict(old)])["expected_failure"].tolist() == [""]


def test_the_report_marks_expected_failures_and_shows_expected_ones_that_passed(tmp_path: Path) -> None:
    expected, fixed, good, broken = cell_cases(4, checkpoint="local", sharding_strategy="hybrid_shard")
    results = write_results(tmp_path / "r.jsonl", [
        record(expected, "error", None, reason="Global rank 0 does not exist", expected_failure=KNOWN),
        record(fixed, "pass", 0.1, expected_failure=KNOWN),
        record(good, "pass", 0.1),
        record(broken, "fail", 30.0),
    ])
    summary = reports.build(results, tmp_path / "out")
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (on_disk["expected_failures"], on_disk["unexpected_passes"], on_disk["verdicts"]["error"]) == (1, 1, 1)
    assert on_disk["matrices"][0]["expected"] == 1 and on_disk["ok"] is False, "the unexpected fail still counts"
    assert summary.ran == 3

    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "Parity report: 2/3 cases pass, 1 expected failure(s), 1 expected to fail passed" in md
    assert "## Cases that did not pass (2, 1 expected)" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    failing = [r for r in rows if "Global rank 0" in r or "fail: synthetic" in r]
    assert len(failing) == 2 and "error (expected)" in failing[1] and f"**expected:** {KNOWN}" in failing[1], (
        "the expected failure is listed last, marked, with its expectation next to its reason"
    )
    assert "| fail " in failing[0] and "expected" not in failing[0]
    assert "## Expected to fail, passed (1)" in md and fixed.case_id in md
    assert "2/3 · 30 +1x" in md and "`+Nx`: N expected failures" in md
    assert "2/3 +1x" in md, "the checkpoint table counts it apart too"

    html = (tmp_path / "out" / "matrix.html").read_text()
    assert "<td>error (expected)</td>" in html and f"<i>expected:</i> {KNOWN}" in html.replace("&#x27;", "'")
    assert "Expected to fail, passed (1)" in html and "<br>+1x" in html
    fixed_page = (tmp_path / "out" / case_href(fixed.full_id)).read_text().replace("&#x27;", "'")
    assert f"Expected to fail, passed:</b> {KNOWN}" in fixed_page
    expected_page = (tmp_path / "out" / case_href(expected.full_id)).read_text().replace("&#x27;", "'")
    assert f"not new breakage): {KNOWN}" in expected_page


def test_a_run_whose_only_failures_are_expected_is_ok() -> None:
    a, b = cell_cases(2)
    frame = latest(records_frame([record(a, "pass", 0.1), record(b, "crash", None, expected_failure=KNOWN)]))[0]
    summary = summarize(frame, parity_matrices(frame), out_dir="", inputs=[], superseded=0, bad_lines=[])
    assert summary.ok and summary.expected_failures == 1 and summary.ran == 1


def test_a_byte_order_mark_does_not_make_the_first_record_unreadable(small_results: Path, tmp_path: Path) -> None:
    plain, _ = read_records(small_results)
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + small_results.read_bytes())
    records, bad = read_records(marked)
    assert bad == [] and [r.case_id for r in records] == [r.case_id for r in plain]


def test_an_endless_line_is_one_unreadable_line_read_in_bounded_pieces(
    monkeypatch: pytest.MonkeyPatch, small_results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import harness.collect.collector as collector

    monkeypatch.setattr(collector, "MAX_LINE_CHARS", 4096)
    plain, _ = read_records(small_results)
    long = tmp_path / "long.jsonl"
    long.write_text('{"case": "' + "x" * 10_000 + '"}\n' + small_results.read_text())
    records, bad = read_records(long)
    assert len(records) == len(plain) and len(bad) == 1, "the records after it are read"
    assert bad[0].line == 1 and "longer than 4096 characters" in bad[0].reason and len(bad[0].head) <= 200
    # /dev/zero never ends its line: reading stops at the cap, one unreadable line, exit 2.
    assert main(["build", "/dev/zero", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "(1 unreadable line(s), the first /dev/zero:1: longer than 4096" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_html_header_shows_code_not_backticks(built) -> None:
    _, out, summary = built
    html = (out / "matrix.html").read_text(encoding="utf-8")
    assert "`" not in html
    assert f"<code>{summary.runs[0]['run_id']}</code>" in html


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["build", "history"])
@pytest.mark.parametrize("fault, status", [(OSError(28, "No space left on device", "heatmap.png"), 2),
                                           (KeyboardInterrupt(), 130)])
def test_a_report_is_written_whole_or_not_at_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    command: str, fault: BaseException, status: int
) -> None:
    import matplotlib.figure

    night = tmp_path / "nightly" / "2026-11-22"
    night.mkdir(parents=True)
    results = write_results(night / "results.jsonl", [record(CaseConfig(steps=1), "fail", 3.0), record(CaseConfig(steps=2))])
    argv = [command, str(results if command == "build" else night)]
    out = tmp_path / "report"
    assert main([*argv, "--out", str(out)]) == 0
    before = _tree(out)
    capsys.readouterr()
    (night / "results.jsonl").write_text((night / "results.jsonl").read_text().replace('"fail"', '"pass"'))

    def fail(*args: object, **kwargs: object) -> None:  # the disk fills, or Ctrl-C, half-way through the plots
        raise fault

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail)
    for target in (out, tmp_path / "fresh"):
        assert main([*argv, "--out", str(target)]) == status
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err and f"{target} is left as it was" in err, err
        assert ("No space left on device: heatmap.png" in err) if status == 2 else ("interrupted" in err)
    assert _tree(out) == before, "the earlier report is whole and untouched"
    assert not (tmp_path / "fresh").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nightly", "report"]
