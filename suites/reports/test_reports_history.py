"""History across nights: verdicts and ratios per night, fixes and regressions with their nights."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from history_nights import NIGHTS, fixed_case, hung_case, night_cases, regressed_case, write_nights
from synthetic_records import RUN, record

from harness.collect.collector import ResultWriter

from reports.__main__ import main
from reports.history import failing_now, flatten_numbers, history, load_night, sibling_nights, transitions, verdict_counts


@pytest.fixture(scope="module")
def three_nights(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Path]:
    tmp = tmp_path_factory.mktemp("history")
    nights = write_nights(tmp / "nightly")
    return nights, tmp / "history"


def test_a_fix_and_a_regression_are_shown_with_the_nights_they_changed(three_nights) -> None:
    nights, out = three_nights
    result = history(list(reversed(nights)), out)  # ordered by name, whatever the argument order
    assert result.nights == list(NIGHTS)
    (fixed,) = result.of_kind("fixed")
    (regressed,) = result.of_kind("regressed")
    assert (fixed["full_id"], fixed["night"], fixed["previous_night"]) == (fixed_case().full_id, NIGHTS[1], NIGHTS[0])
    assert (regressed["full_id"], regressed["night"], regressed["old"], regressed["new"]) == (
        regressed_case().full_id, NIGHTS[2], "pass", "fail")
    failing = {f["full_id"]: f for f in result.failing}
    assert set(failing) == {regressed_case().full_id, hung_case().full_id}
    assert (failing[hung_case().full_id]["failing since"], failing[hung_case().full_id]["nights failing"]) == (NIGHTS[0], 3)
    assert failing[regressed_case().full_id]["failing since"] == NIGHTS[2]

    md = (out / "history.md").read_text()
    assert f"| {NIGHTS[1]} | {fixed_case().full_id} | fail → pass | {NIGHTS[0]}" in md
    assert f"| {NIGHTS[2]} | {regressed_case().full_id} | pass → fail | {NIGHTS[1]}" in md
    assert f"{NIGHTS[1]}: Partial run: 2 of {len(night_cases())} selected cases were not run" in md
    assert "step_time_ratio.full_shard" in md
    html = (out / "history.html").read_text()
    for png in ("history_verdicts.png", "history_ratios.png", "history_perf.png"):
        assert (out / png).stat().st_size > 5_000 and f'src="{png}"' in html
    assert json.loads((out / "history.json").read_text())["nights"] == list(NIGHTS)


def test_a_night_that_did_not_run_a_case_changes_nothing() -> None:
    timeline = pd.DataFrame({"n1": ["fail", "pass"], "n2": ["", "pass"], "n3": ["fail", "timeout"]}, index=["a", "b"])
    changes = transitions(timeline)
    assert [(c.full_id, c.night, c.previous_night, c.kind) for c in changes] == [("b", "n3", "n2", "regressed")]
    now = failing_now(timeline).set_index("full_id")
    assert now.loc["a", "failing since"] == "n1" and now.loc["a", "nights failing"] == 2
    assert now.loc["b", "failing since"] == "n3" and now.loc["b", "first failed"] == "n3"


def test_an_expected_failure_is_neither_failing_now_nor_a_regression(tmp_path: Path) -> None:
    known, gone = night_cases()[:2]
    bug = "torch FSDP1: a known bug (strict xfail)"
    nights = {"n1": [record(known), record(gone, "error", None, reason="boom", expected_failure=bug)],
              "n2": [record(known, "error", None, reason="boom", expected_failure=bug), record(gone, expected_failure=bug)]}
    for name, records in nights.items():
        (tmp_path / name).mkdir()
        with ResultWriter(tmp_path / name / "results.jsonl", RUN) as writer:
            for r in records:
                writer.append(r)
    result = history([tmp_path / "n1", tmp_path / "n2"], tmp_path / "out")
    assert result.failing == [] and result.of_kind("regressed") == [] and result.of_kind("fixed") == []
    changes = {(c["full_id"], c["old"], c["new"]) for c in result.of_kind("changed")}
    assert changes == {(known.full_id, "pass", "expected"), (gone.full_id, "expected", "pass")}
    counts = verdict_counts([load_night(tmp_path / "n2")]).iloc[0]
    assert (counts["expected"], counts["error"], counts["pass"], counts["ran"]) == (1, 0, 1, 2)


def test_perf_sections_flatten_to_numbers() -> None:
    assert flatten_numbers({"a": {"b": 1.5, "c": [2, {"d": 3}]}, "ok": True, "s": "x", "n": float("nan")}) == {
        "a.b": 1.5, "a.c.0": 2.0, "a.c.1.d": 3.0}


def test_cli_history(three_nights, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nights, _ = three_nights
    assert main(["history", *map(str, nights), "--out", str(tmp_path / "h")]) == 0
    assert "1 regression(s), 1 fix(es), 2 failing now" in capsys.readouterr().out
    assert main(["history", str(tmp_path / "missing"), "--out", str(tmp_path / "h2")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_harness_history_is_the_same_page(three_nights, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main as harness_main

    nights, _ = three_nights
    assert harness_main(["history", *map(str, nights), "--out", str(tmp_path / "h")]) == 0
    assert "1 regression(s), 1 fix(es), 2 failing now" in capsys.readouterr().out
    assert (tmp_path / "h" / "history.html").exists()


def test_harness_history_is_an_alias_of_the_one_implementation() -> None:
    """``python -m harness history`` runs ``python -m reports history``'s code with its arguments, no argv rebuilt."""
    import reports.__main__ as reports_cli
    from harness.cli import history

    assert history.main is reports_cli.run and history.add_arguments is reports_cli.add_history_arguments


def test_a_nightly_finds_itself_and_the_nights_before_it(three_nights, tmp_path: Path) -> None:
    nights, _ = three_nights
    (nights[0].parent / "2026-11-19-empty").mkdir(exist_ok=True)  # no results: not a night
    assert sibling_nights(nights[1]) == nights[:2]
    assert sibling_nights(nights[2], limit=2) == nights[1:]


def test_a_zero_ratio_is_not_drawn_as_a_small_one_on_the_log_plot() -> None:
    import math

    import pandas as pd

    from reports.history import line_figure

    table = pd.DataFrame({"builtin": [0.0, 0.2, 0.0], "torch-fsdp": [0.5, 0.3, 0.4]}, index=["n1", "n2", "n3"])
    fig = line_figure(table, "worst error / tolerance", log=True, threshold=1.0)
    builtin = next(line for line in fig.axes[0].get_lines() if line.get_label() == "builtin")
    ys = list(builtin.get_ydata())
    assert math.isnan(ys[0]) and ys[1] == 0.2 and math.isnan(ys[2])
    assert min(v for line in fig.axes[0].get_lines() for v in line.get_ydata() if not math.isnan(v)) >= 0.2
    notes = [t.get_text() for t in fig.texts]
    assert notes == ["0 (exact match), not drawn on the log scale: builtin on n1; builtin on n3"]
    # On a linear scale a zero is a value like any other.
    assert list(line_figure(table, "value", log=False).axes[0].get_lines()[0].get_ydata()) == [0.0, 0.2, 0.0]


@pytest.mark.parametrize("garbage, unknown", [
    ('{"case": {"engine": "builtin", "ste\n', True),  # only a cut line
    ('{"schema": 99, "case_id": "from-the-future", "verdict": "pass"}\n', True),  # a newer schema
    (None, False),  # readable records and one cut line after them
])
def test_an_unreadable_newest_night_is_never_green(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], garbage: str | None, unknown: bool
) -> None:
    old, new = tmp_path / "nightly" / NIGHTS[0], tmp_path / "nightly" / NIGHTS[1]
    for night in (old, new):
        night.mkdir(parents=True)
        with ResultWriter(night / "results.jsonl", RUN) as writer:
            writer.append(record(night_cases()[0], "pass", 0.1))
    if garbage is not None:
        (new / "results.jsonl").write_text(garbage)
    else:
        with open(new / "results.jsonl", "a") as f:
            f.write('{"case": {"engine"\n')
    code = main(["history", str(old), str(new), "--out", str(tmp_path / "history")])
    captured = capsys.readouterr()
    assert code == (1 if unknown else 0)
    md = (tmp_path / "history" / "history.md").read_text()
    assert md.startswith("# ⚠️ Parity history") and "✅" not in md
    said = f"{NIGHTS[1]} is unreadable: its 1 line(s) hold no readable record" if unknown else f"{NIGHTS[1]}: 1 unreadable line(s)"
    assert said in md and said in (tmp_path / "history" / "history.html").read_text()
    assert f"warning: {said}" in captured.err
    assert json.loads((tmp_path / "history" / "history.json").read_text())["newest_unknown"] is unknown
