"""``--resume`` continues exactly the selection a results file was made with (``harness.run.stored_selection``):
no case of another selection added, none of its own left out, none recorded twice; options that
contradict it are refused by name; a file from before selections were stored resumes as it did, with a
warning naming the options to pass. In-process, with ``run_case`` replaced (no ranks start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.collect.collector import read_records, record_full_id
from harness.run.runner import Selection, select_cases
from harness.run.stored_selection import (
    StoredSelection,
    contradictions,
    read_selection,
    selection_from_options,
    selection_options,
    selection_path,
)

#: a pairwise selection of two engines, cut short by a limit: nothing a default run would select.
PAIRWISE = ["--matrix", "pairwise", "--engines", "builtin,torch-fsdp", "--references", "local", "--limit", "6", "--no-progress"]


def _ids(path: Path) -> list[str]:
    records, bad = read_records(path)
    assert not bad
    return [record_full_id(r) for r in records]


def _interrupted(out: Path, keep: int) -> None:
    """What a Ctrl-C after ``keep`` cases leaves: their lines (the selection file stays)."""
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:keep]))


def test_resume_continues_the_stored_selection_and_nothing_else(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["run", *PAIRWISE, "--out", str(out)]) == 0
    wanted = select_cases(Selection(matrix="pairwise", engines=["builtin", "torch-fsdp"], references=["local"], limit=6), [2])
    assert sorted(_ids(out)) == sorted(c.full_id for c in wanted)
    stored = read_selection(out)
    assert stored is not None and stored.options["matrix"] == "pairwise" and stored.options["limit"] == 6
    _interrupted(out, 2)
    kept = set(_ids(out))
    fake_run_case.clear()
    capsys.readouterr()
    # The printed resume line names only --out and --resume: the file says the rest.
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert sorted(fake_run_case) == sorted({c.full_id for c in wanted} - kept)
    ids = _ids(out)
    assert sorted(ids) == sorted(c.full_id for c in wanted) and len(ids) == len(set(ids)) == 6
    captured = capsys.readouterr()
    assert f"{out} holds 6 cases" in captured.out and "warning" not in captured.err
    # Resumed again: nothing left, nothing added, the same id.
    fake_run_case.clear()
    assert main(["run", *PAIRWISE, "--out", str(out), "--resume"]) == 0
    assert fake_run_case == [] and len(_ids(out)) == 6 and read_selection(out).id == stored.id  # type: ignore[union-attr]


@pytest.mark.parametrize("extra, named", [
    (["--matrix", "smoke"], "--matrix smoke (the file's: pairwise)"),
    (["--limit", "60"], "--limit 60 (the file's: 6)"),  # a larger limit is another sample: refused
    (["--engines", "builtin"], "--engines builtin (the file's: builtin,torch-fsdp)"),
    (["--filter", "nested"], "--filter nested (the file's: none)"),
])
def test_options_contradicting_the_stored_selection_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str], extra: list[str], named: str
) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["run", *PAIRWISE, "--out", str(out)]) == 0
    _interrupted(out, 1)
    before = out.read_text()
    fake_run_case.clear()
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--resume", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("harness run: --resume: ") and named in err and "choose a new --out" in err
    assert len(err.splitlines()) == 1 and fake_run_case == [] and out.read_text() == before


def test_a_file_from_before_stored_selections_resumes_as_today_with_a_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["run", *PAIRWISE, "--out", str(out)]) == 0
    _interrupted(out, 2)
    selection_path(out).unlink()
    fake_run_case.clear()
    capsys.readouterr()
    assert main(["run", *PAIRWISE, "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "was written before results files stored their selection" in err
    assert "--engines builtin" in err and "--references local" in err and "--matrix" in err
    assert len(fake_run_case) == 4 and len(_ids(out)) == 6
    assert read_selection(out) is not None, "stored now: the next resume is exact"


def test_stored_options_round_trip_and_contradictions_are_pure() -> None:
    selection = Selection(matrix="pairwise", engines=["builtin"], filters=["nested"], limit=3)
    options = selection_options(selection, [2, 4])
    assert selection_from_options(options) == (selection, [2, 4])
    # An option this version does not know is ignored; one the file lacks keeps its default.
    assert selection_from_options({**options, "from_the_future": 1})[0] == selection
    assert selection_from_options({"matrix": "full"})[0] == Selection(matrix="full")
    given = selection_options(Selection(matrix="pairwise", engines=["builtin"], limit=9), [2])
    assert contradictions(options, given, {"matrix", "limit"}) == ["--limit 9 (the file's: 3)"]
    assert contradictions(options, given, set()) == []
    a = StoredSelection(options, ("x", "y"))
    assert a.id == StoredSelection(dict(options), ("y", "x")).id != StoredSelection(options, ("x",)).id
    assert StoredSelection.from_dict(a.to_dict()) == a


def test_the_default_engines_given_again_explicitly_are_no_contradiction(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    from harness.cases.case import DEFAULT_ENGINES

    out = tmp_path / "r.jsonl"
    small = ["--matrix", "smoke", "--models", "nested", "--limit", "3", "--no-progress"]
    assert main(["run", *small, "--out", str(out)]) == 0
    assert read_selection(out).options["engines"] is None  # type: ignore[union-attr]
    _interrupted(out, 1)
    fake_run_case.clear()
    assert main(["run", *small, "--engines", ",".join(DEFAULT_ENGINES), "--out", str(out), "--resume"]) == 0
    assert len(fake_run_case) == 2 and len(_ids(out)) == 3
    assert main(["run", *small, "--engines", "builtin", "--out", str(out), "--resume"]) == 2, "another value still is refused"


@pytest.mark.parametrize("text, why", [("[]", "not a selection"), ('{"id": "ab", "options": {"matr', "Unterminated string"),
                                       ('{"options": [], "case_ids": []}', "not a selection")])
@pytest.mark.parametrize("command", ["run", "nightly"])
def test_an_unreadable_selection_file_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str], text: str, why: str, command: str
) -> None:
    out = tmp_path / "r.jsonl" if command == "run" else tmp_path / "night" / "results.jsonl"
    out.parent.mkdir(exist_ok=True)
    out.write_text("")
    selection_path(out).write_text(text)
    where = str(out) if command == "run" else str(out.parent)
    assert main([command, "--out", where, "--resume", "--no-progress", "--matrix", "smoke", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--resume: {selection_path(out)} cannot be read ({why}" in err and "restore it, or delete it" in err
    assert fake_run_case == [] and out.read_text() == "" and selection_path(out).read_text() == text
    from reports.api import selection_ids

    assert selection_ids(out) == set(), "the reports read such results without a selection"
