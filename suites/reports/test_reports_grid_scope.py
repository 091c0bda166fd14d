"""The comparison grid, and partial runs: the banner on every page (only over the results of the nightly's
own selection), not-run cells, the diff link."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_files import write_results
from synthetic_records import mixed_records, record

import reports
from harness.cases.case import CaseConfig
from harness.cases.records import NotRun, not_run_text, parse_not_run
from harness.collect.collector import record_full_id
from harness.run.stored_selection import StoredSelection, selection_path, write_selection
from harness.selection.matrix import generate
from reports.api import load
from reports.case_page import case_href
from reports.grid import build_grid
from reports.matrix import records_frame
from reports.scope import RunScope, not_run_frame, scope_from_nightly

_AXES = ("engine", "reference", "model", "sharding_strategy", "precision", "backward_prefetch", "forward_prefetch",
         "cpu_offload", "use_orig_params", "init_mode", "world_size", "steps")


@pytest.mark.parametrize("generator", ["pairwise", "smoke"])
def test_not_run_cases_are_read_from_their_config(generator: str) -> None:
    cases = generate(generator) + [CaseConfig(model="moe_sleep_free", steps=3, world_size=8, init_mode="after")]
    listed = parse_not_run(not_run_text((case, "budget") for case in cases))
    assert [n.full_id for n in listed] == [c.full_id for c in cases]
    frame = not_run_frame(RunScope(len(cases), listed))
    assert [{k: row[k] for k in _AXES} for row in frame.to_dict("records")] == [
        {k: getattr(case, k) for k in _AXES} for case in cases]


def test_grid_puts_every_engine_under_the_same_columns_with_distinct_empty_states() -> None:
    fsdp1 = CaseConfig(engine="torch-fsdp", precision="bf16")
    records = [record(fsdp1), record(CaseConfig(engine="builtin", precision="fp16"), "fail", 9.0),
               record(CaseConfig(engine="torch-fsdp2", use_orig_params=True, backward_prefetch="pre"), "unsupported", None)]
    left = CaseConfig(engine="torch-fsdp2", precision="fp16", backward_prefetch="pre")
    not_run = RunScope(3, [NotRun(left.full_id, "budget", left.to_dict())])
    grid = build_grid(records_frame(records), not_run_frame(not_run))
    assert grid.engines == ["builtin", "torch-fsdp", "torch-fsdp2"]
    assert grid.columns == [("fp32", "none"), ("fp32", "pre"), ("bf16", "none"), ("bf16", "pre"), ("fp16", "none"), ("fp16", "pre")]
    (section,) = grid.sections
    rows = {row.engine: row for row in section.rows}
    assert [r.engine for r in section.rows] == grid.engines, "one row per engine, engines next to each other"
    assert rows["torch-fsdp"].cells[("bf16", "none")].state == "pass"
    assert rows["builtin"].cells[("fp16", "none")].state == "fail"
    assert rows["torch-fsdp2"].cells[("fp32", "pre")].state == "unsupported"
    assert rows["torch-fsdp2"].cells[("fp16", "pre")].state == "not_run"
    assert rows["builtin"].cells[("bf16", "none")].state == "absent"


def test_not_run_list_and_nightly_state_parse() -> None:
    case = CaseConfig()
    text = f"{case.full_id}\ttime budget of 240 s spent\t{json.dumps(case.to_dict())}\n\nx:y:z\n"
    assert parse_not_run(text) == [NotRun(case.full_id, "time budget of 240 s spent", case.to_dict()),
                                   NotRun("x:y:z", "not run")]
    # A list written before lines carried the config: its cases count, though no grid cell can show them.
    old = parse_not_run(f"{case.full_id}\ttime budget of 240 s spent\n")
    assert old == [NotRun(case.full_id, "time budget of 240 s spent")]
    assert RunScope(1, old).partial and not_run_frame(RunScope(1, old)).empty
    scope = scope_from_nightly({"cases": {"selected": 10920, "not_run": 10331,
                                          "not_run_reasons": {"time budget of 240 s spent": 10331}}})
    assert len(scope.not_run) == 10331 and scope.partial
    assert scope.banner().startswith("Partial run: 10,331 of 10,920 selected cases were not run (time budget of 240 s spent)")
    assert not scope_from_nightly({"cases": {"selected": 5, "not_run": 0}}).partial


def _partial_nightly(tmp_path: Path) -> tuple[Path, list[CaseConfig]]:
    records = [r for r in mixed_records() if r.case["engine"] == "builtin"]
    ran = {r.case_id for r in records}
    left = [c for c in generate("pairwise", model="nested", reference="ddp", engine="torch-fsdp")][:4]
    d = tmp_path / "nightly"
    d.mkdir()
    write_results(d / "results.jsonl", records)
    stored = StoredSelection({"matrix": "pairwise"}, tuple(sorted({*(record_full_id(r) for r in records), *(c.full_id for c in left)})))
    write_selection(d / "results.jsonl", stored)
    (d / "not_run.txt").write_text(not_run_text((c, "time budget of 240 s spent") for c in left))
    (d / "nightly.json").write_text(json.dumps({"selection": {"id": stored.id}, "cases": {
        "selected": len(records) + len(left), "not_run": len(left),
        "not_run_reasons": {"time budget of 240 s spent": len(left)}}}))
    (d / "diff.md").write_text("# diff\n")
    assert ran
    return d, left


def test_a_partial_nightly_says_so_on_every_page(tmp_path: Path) -> None:
    d, left = _partial_nightly(tmp_path)
    summary = reports.build(d / "results.jsonl", d)
    expected = f"Partial run: {len(left)} of {summary.cases + len(left)} selected cases were not run (time budget of 240 s spent)"
    md, html = (d / "matrix.md").read_text(), (d / "matrix.html").read_text()
    assert md.startswith(f"> ⚠️ **{expected}")
    assert expected in html and html.index('id="partial-run"') < html.index("<h1>")
    pages = list((d / "cases").glob("*.html"))
    assert pages and all(expected in p.read_text() for p in pages)
    assert summary.scope == {"selected": summary.cases + len(left), "not_run": len(left),
                             "reasons": {"time budget of 240 s spent": len(left)}, "not_selected": [],
                             "source": "nightly.json"}
    assert 'href="diff.md"' in html and "(diff.md)" in md
    assert html.count('class="cell not_run"') >= 1, "the cells of the cases not run look like it"


def test_explicit_not_run_overrides_and_a_whole_run_has_no_banner(tmp_path: Path) -> None:
    results = write_results(tmp_path / "r.jsonl", [record(CaseConfig())])
    reports.build(results, tmp_path / "whole")
    assert "Partial run" not in (tmp_path / "whole" / "matrix.html").read_text()
    missing = CaseConfig(precision="bf16").full_id
    summary = reports.build(results, tmp_path / "part", not_run=[(missing, "pool did not start")], selected=2)
    assert summary.scope is not None and summary.scope["reasons"] == {"pool did not start": 1}
    assert "Partial run: 1 of 2 selected cases were not run (pool did not start)" in (tmp_path / "part" / "matrix.md").read_text()


def test_grid_has_filters_sticky_headers_toc_and_legend(built) -> None:
    _, out, _ = built
    html = (out / "matrix.html").read_text()
    for needle in ('id="f-engine"', 'id="f-model"', 'id="f-verdict"', "position: sticky", 'class="gridwrap"',
                   '<nav class="toc">', "not in the matrix", "not run: selected", "unsupported: the engine refused"):
        assert needle in html, needle
    assert html.count('<table class="grid">') == 1, "one grid, not one table per engine x reference x model"
    records = mixed_records()
    for r in records:
        if r.verdict not in ("pass", "unsupported"):
            assert f'href="{case_href(r.case["engine"] + ":" + r.case["reference"] + ":" + r.case_id)}"' in html


def test_a_banner_belongs_only_to_the_results_of_its_own_selection(tmp_path: Path) -> None:
    d, _ = _partial_nightly(tmp_path)
    other = tmp_path / "nightly" / "mine.jsonl"  # another run's results in the same directory
    write_results(other, [record(CaseConfig())])
    write_selection(other, StoredSelection({"matrix": "smoke"}, (CaseConfig().full_id,)))
    assert reports.build(other, tmp_path / "mine").scope is None
    assert "Partial run" not in (tmp_path / "mine" / "matrix.html").read_text()
    selection_path(other).unlink()  # results that say nothing of their selection: not the nightly's either
    assert reports.build(other, tmp_path / "mine").scope is None
    # The nightly's own results, and its report directory, keep the banner.
    assert reports.build(d / "results.jsonl", d).scope["not_run"] == 4
    assert load(d).scope is not None
    state = json.loads((d / "nightly.json").read_text())
    (d / "nightly.json").write_text(json.dumps({**state, "selection": {"id": "another-night"}}))
    assert load(d / "results.jsonl").scope is None


def test_expected_failures_leave_a_cell_passing_or_give_it_its_own_state() -> None:
    known = "a known engine bug"
    frame = records_frame([
        record(CaseConfig(sharding_strategy="full_shard"), "pass", 0.1),
        record(CaseConfig(sharding_strategy="full_shard", use_orig_params=True), "error", None, expected_failure=known),
        record(CaseConfig(sharding_strategy="no_shard"), "crash", None, expected_failure=known),
    ])
    (section,) = build_grid(frame).sections
    states = {row.strategy: row.cells[("fp32", "none")].state for row in section.rows}
    assert states == {"full_shard": "pass", "no_shard": "expected"}
