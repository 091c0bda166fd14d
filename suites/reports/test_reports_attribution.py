"""Failure attribution: the conjunctions of axis values that separate failing from passing cases."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
from report_files import write_results
from synthetic_records import record

import reports
from harness.cases.case import CaseConfig
from harness.selection.matrix import generate
from reports.attribution import AxisValue, attribute, explain
from reports.matrix import records_frame


def _full(engine: str = "torch-fsdp") -> list[CaseConfig]:
    return generate("full", model="nested", reference="ddp", world_size=2, engine=engine)


def _frame(cases: list[CaseConfig], failing, unsupported=lambda c: False) -> pd.DataFrame:
    return records_frame([
        record(c, "unsupported", None, "refused") if unsupported(c)
        else record(c, "fail", 40.0) if failing(c) else record(c, "pass", 0.1)
        for c in cases
    ])


def _no_shard_offload_orig(c: CaseConfig) -> bool:
    return c.sharding_strategy == "no_shard" and c.cpu_offload and c.use_orig_params


def test_one_conjunction_names_a_three_setting_failure() -> None:
    cases = _full()
    (a,) = attribute(_frame(cases, _no_shard_offload_orig))
    failing = sum(map(_no_shard_offload_orig, cases))
    assert (a.engine, a.reference, a.failing) == ("torch-fsdp", "ddp", failing)
    (term,) = a.terms
    assert term.text == "no_shard & offload & orig"
    assert term.literals == (AxisValue("sharding_strategy", "no_shard"), AxisValue("cpu_offload", True),
                             AxisValue("use_orig_params", True))
    assert term.covered == failing and a.separable and not a.unexplained
    assert a.lines() == [f"`no_shard & offload & orig`: {failing}/{failing} failing case(s), no passing case"]


def test_the_shortest_separating_term_wins() -> None:
    """Every fp16 case fails: ``fp16`` alone, not one of its longer supersets."""
    (a,) = attribute(_frame(_full(), lambda c: c.precision == "fp16"))
    assert [t.text for t in a.terms] == ["fp16"]


def test_overlapping_failure_sets_are_covered_by_one_term_each() -> None:
    first = lambda c: c.cpu_offload and c.precision == "bf16"  # noqa: E731
    second = lambda c: c.sharding_strategy == "shard_grad_op" and c.backward_prefetch == "post"  # noqa: E731
    cases = _full()
    (a,) = attribute(_frame(cases, lambda c: first(c) or second(c)))
    texts = {t.text: t for t in a.terms}
    assert set(texts) == {"bf16 & offload", "shard_grad_op & bwd_post"}
    assert texts["bf16 & offload"].covered == sum(map(first, cases))
    assert texts["shard_grad_op & bwd_post"].covered == sum(map(second, cases))
    # The greedy takes the larger set first; the second then only adds what the first left.
    big, small = a.terms
    assert big.covered >= small.covered and small.newly_covered == small.covered - sum(first(c) and second(c) for c in cases)
    assert a.separable


def test_noise_is_reported_as_unexplained_not_as_a_pattern() -> None:
    cases = _full()
    rng = random.Random(7)
    flakes = {c.full_id for c in rng.sample([c for c in cases if not _no_shard_offload_orig(c)], 3)}
    (a,) = attribute(_frame(cases, lambda c: _no_shard_offload_orig(c) or c.full_id in flakes))
    assert [t.text for t in a.terms] == ["no_shard & offload & orig"]
    assert set(a.unexplained) == flakes and not a.separable
    (line,) = [line for line in a.lines() if "not separated" in line]
    assert line.startswith("3/")


def test_a_cause_needing_more_than_three_settings_is_said_to_be_inseparable() -> None:
    four = lambda c: _no_shard_offload_orig(c) and c.precision == "fp16"  # noqa: E731
    cases = _full()
    (a,) = attribute(_frame(cases, four))
    assert a.terms == [] and len(a.unexplained) == sum(map(four, cases))
    (wide,) = attribute(_frame(cases, four), max_literals=4)
    assert [t.text for t in wide.terms] == ["no_shard & fp16 & offload & orig"]


def test_unsupported_cases_take_no_side() -> None:
    """FSDP2-like refusals of every no_shard case must not stop ``no_shard`` from explaining failures."""
    cases = _full()
    frame = _frame(cases, lambda c: c.sharding_strategy == "no_shard" and not c.cpu_offload,
                   unsupported=lambda c: c.sharding_strategy == "no_shard" and c.cpu_offload)
    (a,) = attribute(frame)
    assert [t.text for t in a.terms] == ["no_shard"]


def test_the_result_does_not_depend_on_row_order() -> None:
    cases = _full()
    failing = lambda c: (c.cpu_offload and c.precision == "fp16") or (c.use_orig_params and c.init_mode == "never")  # noqa: E731
    frame = _frame(cases, failing)
    shuffled = frame.sample(frac=1.0, random_state=3)
    assert explain(frame) == explain(shuffled)


def test_attribution_is_at_the_top_of_both_reports_and_in_the_summary(tmp_path: Path) -> None:
    cases = [c for c in _full("torch-fsdp") if c.precision == "fp32"] + [c for c in _full("builtin") if c.precision == "fp32"]
    records = [record(c, "fail", 40.0) if c.engine == "torch-fsdp" and _no_shard_offload_orig(c) else record(c)
               for c in cases]
    out = tmp_path / "out"
    reports.build(write_results(tmp_path / "r.jsonl", records), out)
    md = (out / "matrix.md").read_text()
    assert md.index("## Failure attribution") < md.index("## torch-fsdp vs ddp")
    assert "`no_shard & offload & orig`" in md and "**builtin vs ddp**: no failing case" in md
    html = (out / "matrix.html").read_text()
    assert html.index('id="attribution"') < html.index('id="grid"')
    assert "<code>no_shard &amp; offload &amp; orig</code>" in html
    summary = json.loads((out / "summary.json").read_text())
    by_engine = {a["engine"]: a for a in summary["attribution"]}
    assert by_engine["torch-fsdp"]["terms"][0]["term"] == "no_shard & offload & orig"
    assert by_engine["torch-fsdp"]["terms"][0]["literals"][1] == {"axis": "cpu_offload", "value": True}
    assert by_engine["builtin"]["failing"] == 0 and by_engine["builtin"]["separable"]


def test_knob_checks_outweigh_coincidences_and_a_small_sample_says_so() -> None:
    """The toy-buggy shape: a pairwise sample where the reduce dtype is ignored. Axis values single out
    some coincidence; the knob check names the cause, and the sample is too small to attribute."""
    cases = generate("pairwise", model="nested", reference="local", world_size=2, engine="torch-fsdp")
    failing = [c for c in cases if c.precision == "reduce_only"]
    records = []
    for c in cases:
        r = record(c, "fail", 30.0, reason="knob precision ignored: gradient reductions in ['float32'], expected float16") \
            if c in failing else record(c, "pass", 0.1)
        r.detail["knobs"] = [{"knob": "precision", "status": "ignored" if c in failing else "ok", "reason": "x"},
                             {"knob": "sharding_strategy", "status": "ok", "reason": ""}]
        records.append(r)
    [a] = attribute(records_frame(records))
    assert a.knobs == {"precision": len(failing)} and a.too_small
    lines = a.lines()
    assert lines[0] == f"knob check `precision`: ignored in {len(failing)}/{len(failing)} failing case(s), a cause the trace shows"
    assert "too few to attribute" in lines[1] and "candidates, not causes" in lines[1]
    assert a.to_dict()["knobs"] == {"precision": len(failing)}
    # The full matrix is large enough; without failed knob checks there is no knob evidence.
    [b] = attribute(_frame(_full(), lambda c: c.cpu_offload and c.use_orig_params))
    assert not b.too_small and b.knobs == {} and not b.evidence()


def test_an_intermittent_failure_is_located_by_the_settings_its_failures_share(tmp_path: Path) -> None:
    """A race fails about half the runs of its configuration: no term separates it, but every failure
    shares ``no_shard & offload & orig``, and the attribution says so with the failure rate."""
    cases = _full()
    racy = [c for c in cases if _no_shard_offload_orig(c)]
    rng = random.Random(11)
    unlucky = {c.full_id for c in rng.sample(racy, len(racy) // 2)}
    frame = _frame(cases, lambda c: c.full_id in unlucky)
    (a,) = attribute(frame)
    assert a.terms == [] and set(a.unexplained) == unlucky
    assert a.shared is not None and a.shared.text == "no_shard & offload & orig"
    assert (a.shared.failing, a.shared.matched) == (len(unlucky), len(racy))
    line = a.lines()[-1]
    assert line.startswith(f"all {len(unlucky)} share `no_shard & offload & orig`: {len(unlucky)} of the {len(racy)} cases")
    assert a.to_dict()["shared"]["literals"][0] == {"axis": "sharding_strategy", "value": "no_shard"}
    # One failing case is no pattern; two that differ in every varying axis share nothing that narrows.
    (one,) = attribute(_frame(cases, lambda c: c.full_id == racy[0].full_id))
    assert one.shared is None
    first = cases[0]
    other = next(c for c in cases if all(getattr(c, axis) != getattr(first, axis) for axis in
                                         ("sharding_strategy", "precision", "backward_prefetch", "forward_prefetch",
                                          "cpu_offload", "use_orig_params", "init_mode")))
    (apart,) = attribute(_frame(cases, lambda c: c.full_id in (first.full_id, other.full_id)))
    assert apart.terms == [] and apart.shared is None
    # Both reports show it.
    records = [record(c, "fail", 40.0) if c.full_id in unlucky else record(c) for c in cases]
    reports.build(write_results(tmp_path / "r.jsonl", records), tmp_path / "out")
    assert "share `no_shard & offload & orig`" in (tmp_path / "out" / "matrix.md").read_text()
    assert "share <code>no_shard &amp; offload &amp; orig</code>" in (tmp_path / "out" / "matrix.html").read_text()


def test_expected_failures_take_no_side() -> None:
    """Known engine bugs carry their own reason: they neither need a term nor stop one from separating."""
    cases = _full()
    frame = _frame(cases, _no_shard_offload_orig)
    known = [i for i, c in enumerate(cases) if c.sharding_strategy == "full_shard" and c.cpu_offload]
    frame.loc[known, "verdict"] = "error"
    frame.loc[known, "expected_failure"] = "a known bug"
    (a,) = attribute(frame)
    assert [t.text for t in a.terms] == ["no_shard & offload & orig"] and not a.unexplained
    assert a.failing == sum(map(_no_shard_offload_orig, cases)) and a.expected == len(known)
    assert a.counts("passing").endswith(f", {len(known)} expected failure(s) not attributed")
