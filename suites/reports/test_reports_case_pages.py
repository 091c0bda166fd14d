"""Case drill-down pages: per-step plot, worst quantities, knobs, tolerance, stacks, the rerun command."""

from __future__ import annotations

import argparse
import shlex
from html import escape as html_escape
from pathlib import Path

import matplotlib.image
import pytest
from report_files import write_results
from synthetic_records import RUN, record

import reports
from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, QuantityError
from harness.cli import build_parser
from harness.cli.options import selection_options
from harness.compare.parity import RankResult, record_from_outcome
from harness.ranks.pool import PoolOutcome
from harness.run.runner import select_cases
from reports.__main__ import main
from reports.case_page import case_href, case_slug, rerun_caveats, rerun_command, step_errors

CASE = CaseConfig(engine="torch-fsdp", sharding_strategy="no_shard", cpu_offload=True, use_orig_params=True, steps=4)


def diverging(case: CaseConfig = CASE) -> CaseRecord:
    """A failing record as ``harness.compare.parity.record_from_outcome`` writes it: curves, per-step errors, knobs."""
    ref = [[2.0, 1.6, 1.3, 1.1], [2.1, 1.7, 1.35, 1.15]]
    eng = [[2.0, 1.6, 1.9, 7.5], [2.1, 1.7, 2.2, 9.0]]
    errors = [QuantityError(f"loss@{s}", abs(eng[1][s] - ref[1][s]), 0.0, 1e-5, 1.3e-6, s < 2,
                            abs(eng[1][s] - ref[1][s]) / (1e-5 + 1.3e-6 * ref[1][s])) for s in range(4)]
    errors += [QuantityError("grad:module.0.weight", 3.0, 0.8, 1e-5, 1.3e-6, False, 2.9e5),
               QuantityError("param:module.0.weight", 0.5, 0.1, 1e-5, 1.3e-6, False, 4.8e4),
               QuantityError("param:module.3.bias", 0.0, 0.0, 1e-5, 1.3e-6, True, 0.0)]
    return CaseRecord(
        case=case.to_dict(), case_id=case.case_id, verdict="fail", run=RUN, time=1.0, errors=errors,
        reason="grad:module.0.weight: max_abs 3 exceeds atol 1e-05 (ratio 2.9e5) at step 3 on rank 1",
        detail={"knobs": [{"knob": "cpu_offload", "status": "ok", "reason": "sharded parameters on ['cpu']"},
                          {"knob": "use_orig_params", "status": "ignored", "reason": "yields <flat> parameters"}],
                "worst_at": {"grad:module.0.weight": {"rank": 1, "step": 3}}, "budget_source": "none"},
        curves={"loss": {"engine": eng, "reference": ref}, "grad_norm": {"engine": eng, "reference": ref}},
    )


def hung(case: CaseConfig) -> CaseRecord:
    return CaseRecord(case=case.to_dict(), case_id=case.case_id, verdict="timeout", run=RUN, time=1.0,
                      reason="no answer within 300 s", detail={
                          "stacks": {"0": "File \"x.py\", line 3, in all_gather <wait>"},
                          "stderr_tails": {"1": "NCCL WARN <timeout> & more"}, "exit_codes": {"1": -9}})


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pages")
    passing = CaseConfig(engine="torch-fsdp")
    records = [diverging(), hung(CaseConfig(engine="builtin", precision="bf16")), record(passing),
               record(CaseConfig(engine="torch-fsdp2", sharding_strategy="no_shard"), "unsupported", None, "no NO_SHARD")]
    results = write_results(tmp / "results.jsonl", records)
    reports.build(results, tmp / "out", cases=[passing.full_id])
    return tmp / "out"


def test_every_case_that_did_not_pass_gets_a_page_and_a_passing_one_on_request(built: Path) -> None:
    pages = sorted(p.name for p in (built / "cases").glob("*.html"))
    assert pages == sorted(f"{case_slug(c.full_id)}.html" for c in (
        CASE, CaseConfig(engine="builtin", precision="bf16"), CaseConfig(engine="torch-fsdp"),
        CaseConfig(engine="torch-fsdp2", sharding_strategy="no_shard")))


def test_a_failing_case_page_shows_its_curves_quantities_knobs_and_tolerance(built: Path) -> None:
    page = (built / case_href(CASE.full_id)).read_text()
    png = built / "cases" / f"{case_slug(CASE.full_id)}.png"
    assert f'<img src="{png.name}"' in page
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 400 and image.shape[1] > 600, "three panels: losses, difference, error / tolerance"
    assert page.index("grad:module.0.weight") < page.index("param:module.0.weight") < page.index("param:module.3.bias")
    assert "rank 1, step 3" in page or "step 3, rank 1" in page
    assert "use_orig_params" in page and "<b>ignored</b>" in page
    assert "Source: <b>none</b>" in page and "torch.testing.assert_close" in page
    assert 'href="../matrix.html"' in page


def test_a_timeout_page_shows_the_stacks_and_stderr_escaped(built: Path) -> None:
    page = (built / case_href(CaseConfig(engine="builtin", precision="bf16").full_id)).read_text()
    assert "<h2>Stacks</h2>" in page and "all_gather &lt;wait&gt;" in page
    assert "<h2>stderr</h2>" in page and "NCCL WARN &lt;timeout&gt; &amp; more" in page
    assert "rank 1: -9" in page and "<img" not in page


def test_markdown_and_grid_link_to_the_same_pages(built: Path) -> None:
    md = (built / "matrix.md").read_text()
    html = (built / "matrix.html").read_text()
    for case in (CASE, CaseConfig(engine="builtin", precision="bf16")):
        assert f"]({case_href(case.full_id)})" in md
        assert f'href="{case_href(case.full_id)}"' in html


def test_the_rerun_command_selects_exactly_the_case() -> None:
    for case in (CASE, CaseConfig(engine="builtin", model="transformer", world_size=4, sharding_strategy="hybrid_shard"),
                 CaseConfig(engine="torch-fsdp2", use_orig_params=True, backward_prefetch="pre", steps=3, init_mode="never")):
        assert rerun_caveats(case.to_dict()) == []
        argv = shlex.split(rerun_command(case.to_dict(), case.full_id, "gloo"))
        assert argv[:4] == ["python3", "-m", "harness", "run"]
        args = build_parser().parse_args(argv[3:])
        assert isinstance(args, argparse.Namespace) and args.backend == "gloo"
        assert [c.full_id for c in select_cases(selection_options(args).selection(), args.world_sizes)] == [case.full_id]


def test_the_page_says_when_the_command_cannot_rerun_the_case() -> None:
    outside = CaseConfig(engine="torch-fsdp2", backward_prefetch="none", extras=(("fault", "exit_rank1"),), seed=3)
    caveats = " ".join(rerun_caveats(outside.to_dict()))
    assert "seed=3" in caveats and "injected fault" in caveats and "FSDP2 always prefetches" in caveats


def test_a_page_plots_per_step_errors_when_the_record_has_no_curves(tmp_path: Path) -> None:
    old = diverging()
    old.curves = None
    data = old.to_dict()
    del data["curves"]  # a record written before curves were kept
    loaded = CaseRecord.from_dict(data)
    assert loaded.curves is None and [s for s in step_errors(loaded.errors)["loss"]] == [0, 1, 2, 3]
    out = tmp_path / "out"
    reports.build(write_results(tmp_path / "r.jsonl", [loaded]), out)
    page = (out / case_href(CASE.full_id)).read_text()
    assert "<img" in page and "no per-step values" in page


def test_unknown_cases_on_request_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = write_results(tmp_path / "r.jsonl", [record(CASE)])
    assert main(["build", str(results), "--out", str(tmp_path / "out"), "--cases", "builtin:ddp:nope"]) == 2
    assert "builtin:ddp:nope" in capsys.readouterr().err


def test_record_from_outcome_keeps_both_sides_curves_per_rank() -> None:
    def value(rank: int) -> RankResult:
        return RankResult("ok", engine_s=0.1, reference_s=0.1,
                          curves={"loss": {"engine": [1.0 + rank, 0.5], "reference": [1.0 + rank, 0.4]},
                                  "grad_norm": {"engine": [3.0], "reference": [3.0 + rank]}})

    rec = record_from_outcome(CASE, PoolOutcome("ok", [value(0), value(1)]))
    assert rec.curves == {"loss": {"engine": [[1.0, 0.5], [2.0, 0.5]], "reference": [[1.0, 0.4], [2.0, 0.4]]},
                          "grad_norm": {"engine": [[3.0], [3.0]], "reference": [[3.0], [4.0]]}}
    assert CaseRecord.from_dict(rec.to_dict()).curves == rec.curves


def test_a_long_reason_is_never_cut_without_an_ellipsis_and_a_link_to_the_whole(tmp_path: Path) -> None:
    from reports.render import REASON_CHARS, clip

    tail = "gradient reductions in ['float32'], expected float16"
    reason = "knob precision: " + "the engine reduced " * 12 + tail
    case = CaseConfig(precision="reduce_only")
    summary = reports.build(write_results(tmp_path / "r.jsonl", [record(case, "fail", 3.0, reason=reason)]), tmp_path / "out")
    assert summary.cases == 1
    html = (tmp_path / "out" / "matrix.html").read_text()
    md = (tmp_path / "out" / "matrix.md").read_text()
    page = (tmp_path / "out" / case_href(case.full_id)).read_text()
    assert html_escape(tail) in page, "the case page holds the whole reason"
    for where in ("table", "popup"):
        shown, cut = clip(reason, REASON_CHARS[where])
        assert cut and shown.endswith("…") and shown[:-1].rstrip() in reason and len(shown) <= REASON_CHARS[where]
    assert html.count('(whole reason)</a>') >= 2 and html.count(f'href="{case_href(case.full_id)}"') >= 3
    assert "… ([whole reason](" in md and tail not in md
    assert clip("short", 10) == ("short", False)


def test_every_tolerance_source_is_in_the_legend() -> None:
    from typing import get_args

    from harness.compare.tolerance import BudgetSource
    from reports.case_page import BUDGET_SOURCES

    assert set(BUDGET_SOURCES) == set(get_args(BudgetSource))


def test_a_spent_budget_writes_every_page_but_no_more_plots(tmp_path: Path) -> None:
    import time

    results = write_results(tmp_path / "results.jsonl", [diverging()])
    summary = reports.build(results, tmp_path / "out", plot_deadline=time.monotonic())  # already spent
    page = (tmp_path / "out" / case_href(CASE.full_id)).read_text()
    assert "Not plotted: the time budget was spent" in page and "<img" not in page
    assert not list((tmp_path / "out" / "cases").glob("*.png")) and any(f.endswith(".html") for f in summary.files)
    reports.build(results, tmp_path / "whole", plot_deadline=time.monotonic() + 600)
    assert list((tmp_path / "whole" / "cases").glob("*.png"))


def test_a_case_page_links_the_same_case_against_the_other_reference(tmp_path: Path) -> None:
    # Mixed precision against DDP is unsupported ("see this case against local"): its page leads there.
    against_ddp = CaseConfig(engine="builtin", precision="bf16", reference="ddp")
    against_local = against_ddp.replace(reference="local")
    alone = CaseConfig(engine="torch-fsdp", precision="fp16", reference="ddp")
    records = [record(against_ddp, "unsupported", None, "mixed precision (bf16) against ddp: see this case against local"),
               record(against_local, "fail", 3.0), record(alone, "unsupported", None, "mixed precision (fp16) against ddp")]
    reports.build(write_results(tmp_path / "results.jsonl", records), tmp_path / "out")
    page = (tmp_path / "out" / case_href(against_ddp.full_id)).read_text()
    assert f'<a href="{case_slug(against_local.full_id)}.html">fail: <code>{against_local.full_id}</code></a>' in page
    back = (tmp_path / "out" / case_href(against_local.full_id)).read_text()
    assert f'<a href="{case_slug(against_ddp.full_id)}.html">unsupported' in back
    # Not in the results: the command that runs it there.
    lone = (tmp_path / "out" / case_href(alone.full_id)).read_text()
    other = alone.replace(reference="local")
    assert "not in these results" in lone and html_escape(rerun_command(other.to_dict(), other.full_id, "gloo")) in lone


def test_a_plug_in_engine_not_importable_here_is_labelled_by_its_stored_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = write_results(tmp_path / "r.jsonl", [record(CaseConfig(engine="mine=fsdp1:no_such_module_here"), "fail"),
                                                   record(CaseConfig(engine="theirs=no_such_module_either:Engine"))])
    assert main(["build", str(results), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert "2 cases (pass 1, fail 1)" in capsys.readouterr().out
    assert "mine vs ddp" in (tmp_path / "out" / "matrix.md").read_text()
    page = tmp_path / "out" / case_href("mine:ddp:" + CaseConfig().case_id)
    assert page.exists()
    # A rule of the matrix itself still shows; only the engine's own rules need the engine.
    assert rerun_caveats(CaseConfig(engine="mine=fsdp1:no_such_module_here").to_dict()) == []
    hybrid = {**CaseConfig(engine="mine=fsdp1:no_such_module_here").to_dict(), "sharding_strategy": "hybrid_shard"}
    (caveat,) = rerun_caveats(hybrid)
    assert "the world size must be >= 4" in caveat
