"""One report over the parts of a run (``reports build`` of their results files): the same verdict counts
as the run in one piece, parts of different partitions refused, a missing or unfinished part named in the
banner. In-process: ``run_case`` decides a verdict from the case id (no ranks start), so the verdicts vary
and are the same in every run."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

import reports.__main__ as reports_cli
from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.cli import main

#: the selection: the pairwise matrix of two engines against one reference.
RUN = ["run", "--matrix", "pairwise", "--engines", "builtin,torch-fsdp", "--references", "local", "--no-progress"]


@pytest.fixture
def varied_run_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` records pass, fail or unsupported by a hash of the case id, without starting ranks."""
    import harness.run.runner as runner

    def run_case(pool: Any, case: CaseConfig, timeout_s: float | None = None) -> CaseRecord:
        verdict = ("pass", "pass", "fail", "unsupported")[hashlib.sha256(case.full_id.encode()).digest()[0] % 4]
        return CaseRecord(case.to_dict(), case.case_id, verdict, reason=f"{verdict} on purpose", time=time.time())

    monkeypatch.setattr(runner, "run_case", run_case)


def _build(capsys: pytest.CaptureFixture[str], out: Path, *results: Path) -> tuple[int, dict[str, Any], str]:
    capsys.readouterr()
    code = reports_cli.main(["build", *map(str, results), "--out", str(out)])
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text()) if code == 0 else {}
    return code, summary, err


def _parts(tmp_path: Path, n: int) -> list[Path]:
    outs = [tmp_path / f"{n}" / f"part{k}.jsonl" for k in range(1, n + 1)]
    for k, out in enumerate(outs, 1):
        out.parent.mkdir(exist_ok=True)
        assert main([*RUN, "--part", f"{k}/{n}", "--out", str(out)]) in (0, 1)
    return outs


def test_the_merged_parts_report_the_one_shot_run_s_verdicts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, varied_run_case: None
) -> None:
    whole = tmp_path / "whole.jsonl"
    assert main([*RUN, "--out", str(whole)]) == 1  # some cases fail on purpose
    code, one_shot, _ = _build(capsys, tmp_path / "whole-report", whole)
    assert code == 0 and one_shot["verdicts"].get("fail") and one_shot["verdicts"].get("unsupported")
    parts = _parts(tmp_path, 4)
    code, merged, err = _build(capsys, tmp_path / "merged", *parts)
    assert code == 0 and "incomplete" not in err
    assert merged["cases"] == one_shot["cases"] and merged["verdicts"] == one_shot["verdicts"]
    assert merged["scope"] is None, "all four parts, finished: nothing to say"


def test_parts_of_different_partitions_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, varied_run_case: None
) -> None:
    of_three, of_four = _parts(tmp_path, 3), _parts(tmp_path, 4)
    code, _, err = _build(capsys, tmp_path / "mixed", of_three[0], of_three[1], of_four[2])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "parts of different partitions" in err and str(of_four[2]) in err
    assert not (tmp_path / "mixed" / "summary.json").exists()


def test_a_missing_or_unfinished_part_is_named_in_the_banner(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, varied_run_case: None
) -> None:
    parts = _parts(tmp_path, 4)
    code, summary, err = _build(capsys, tmp_path / "missing", parts[0], parts[1], parts[3])
    assert code == 0 and "warning: incomplete run: part 3/4 missing" in err
    assert summary["scope"]["shards"] == [summary["scope"]["shards"][0]] and "part 3/4 missing" in summary["scope"]["shards"][0]
    page = (tmp_path / "missing" / "matrix.md").read_text()
    assert "Incomplete run: part 3/4 missing" in page
    # Part 2 killed after one case: unfinished, with how many of its cases it lacks.
    lines = parts[1].read_text().splitlines(keepends=True)
    parts[1].write_text(lines[0])
    code, summary, err = _build(capsys, tmp_path / "unfinished", *parts)
    held = json.loads(Path(str(parts[1]) + ".selection.json").read_text())["shard"]["case_ids"]
    assert code == 0
    assert f"part 2/4 unfinished ({len(held) - 1} of {len(held)} cases not recorded" in err
    assert "Incomplete run: part 2/4 unfinished" in (tmp_path / "unfinished" / "matrix.html").read_text()


#: a nightly in parts of a small selection, without the fuzz campaign and the performance section.
NIGHTLY = ["nightly", "--matrix", "pairwise", "--engines", "builtin,torch-fsdp", "--references", "local",
           "--no-progress", "--fuzz-profile", "none", "--no-perf", "--no-determinism-sample"]


def _night(night: Path) -> dict[str, Any]:
    return json.loads((night / "nightly.json").read_text())


def test_a_night_in_parts_merges_and_a_missing_or_killed_part_is_never_green(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    night = tmp_path / "2026-01-02"
    for k in (1, 2):
        assert main([*NIGHTLY, "--out", str(night), "--shard", f"{k}/2"]) == 0
    part1, part2 = night / "shards" / "1-of-2", night / "shards" / "2-of-2"
    assert _night(part2)["shard"]["index"] == 1 and _night(part2)["diff"]["previous"] is None
    assert main(["nightly", "--out", str(night), "--merge-shards"]) == 0
    merged = _night(night)
    assert merged["exit_code"] == 0 and merged["shards"]["merged"] == ["1-of-2", "2-of-2"] and not merged["shards"]["problems"]
    assert sum(merged["verdicts"].values()) == merged["cases"]["selected"] == len(set(fake_run_case))
    # The next night diffs against this merged one, as against any night of its selection.
    later = tmp_path / "2026-01-03"
    for k in (1, 2):  # the options' names; the night above used their old spellings (aliases)
        assert main([*NIGHTLY, "--out", str(later), "--part", f"{k}/2"]) == 0
    assert main(["nightly", "--out", str(later), "--merge-parts"]) == 0
    assert _night(later)["diff"]["previous"] == str(night) and (later / "diff.md").is_file()

    # Part 2 killed after one case: the merge names it and fails; resumed, part 1 untouched, the night is whole.
    lines = (part2 / "results.jsonl").read_text().splitlines(keepends=True)
    (part2 / "results.jsonl").write_text(lines[0])
    (part2 / "nightly.json").write_text(json.dumps({**_night(part2), "complete": False}))
    capsys.readouterr()
    assert main(["nightly", "--out", str(night), "--merge-shards"]) == 1
    out = capsys.readouterr().out
    assert "part 2/2 unfinished" in out and "nightly ok" not in out
    assert "Incomplete run: part 2/2 unfinished" in (night / "matrix.md").read_text()
    before = {p: p.read_bytes() for p in part1.rglob("*") if p.is_file()}
    fake_run_case.clear()
    assert main([*NIGHTLY, "--out", str(night), "--shard", "2/2", "--resume"]) == 0
    assert len(fake_run_case) == len(lines) - 1
    assert {p: p.read_bytes() for p in part1.rglob("*") if p.is_file()} == before
    assert main(["nightly", "--out", str(night), "--merge-shards"]) == 0

    # Part 2 missing altogether.
    import shutil

    shutil.rmtree(part2)
    assert main(["nightly", "--out", str(night), "--merge-shards"]) == 1
    merged = _night(night)
    assert merged["exit_code"] == 1 and any("part 2/2 missing" in r for r in merged["exit_reasons"])
    # ... which the night's own scope says too (reports history reads it there).
    from reports.api import read_scope

    scope = read_scope(night)
    assert scope is not None and scope.partial and "part 2/2 missing" in scope.banner()
    from reports.history import history

    history([night], tmp_path / "history")
    assert "part 2/2 missing" in (tmp_path / "history" / "history.md").read_text()

    # A part of another partition beside them: refused.
    assert main([*NIGHTLY, "--out", str(night), "--shard", "1/3"]) == 0
    capsys.readouterr()
    assert main(["nightly", "--out", str(night), "--merge-shards"]) == 2
    assert "parts of different partitions" in capsys.readouterr().err


def test_a_part_without_cases_has_nothing_to_run_and_is_not_a_failure(
    tmp_path: Path, fake_run_case: list[str]
) -> None:
    one_case = [*NIGHTLY, "--limit", "1", "--out", str(tmp_path)]
    assert main([*one_case, "--part", "2/2"]) == 0 and fake_run_case == []
    assert main([*one_case, "--part", "1/2"]) == 0 and len(fake_run_case) == 1
    assert main(["nightly", "--out", str(tmp_path), "--merge-parts"]) == 0
    assert _night(tmp_path)["shards"]["problems"] == []


def test_part_problems_tell_missing_from_unfinished_from_left_out_by_a_budget() -> None:
    from reports.scope import PartInput, PartMismatch, part_problems

    selection = [f"c{i}" for i in range(6)]

    def part(k: int, ids: list[str], recorded: list[str], not_run: list[str] = (), partition: str = "p") -> PartInput:  # type: ignore[assignment]
        return PartInput(f"s{k}", {"index": k, "count": 3, "partition": partition, "case_ids": ids}, selection,
                         frozenset(recorded), frozenset(not_run))

    whole = [part(0, ["c0", "c3"], ["c0", "c3"]), part(1, ["c1", "c4"], ["c1", "c4"]), part(2, ["c2", "c5"], ["c2", "c5"])]
    assert part_problems(whole) == [] and part_problems([]) == []
    # A time budget listed c4 as not run: partial (the not-run banner says so), not unfinished.
    assert part_problems([whole[0], part(1, ["c1", "c4"], ["c1"], ["c4"]), whole[2]]) == []
    assert part_problems([whole[0], part(1, ["c1", "c4"], ["c1"]), whole[2]]) == [
        "part 2/3 unfinished (1 of 2 cases not recorded: --resume it)"]
    assert part_problems([whole[1]]) == ["parts 1/3, 3/3 missing (4 cases)"]
    with pytest.raises(PartMismatch, match="s2 is part 3/3 of partition q"):
        part_problems([whole[0], part(2, ["c2"], ["c2"], partition="q")])


def test_a_night_merged_before_parts_were_called_parts_still_reads() -> None:
    """A merged night's nightly.json as nights wrote it before "part" replaced "shard" (the same keys are
    still written; the texts said "shard"): its problems make the banner, its skipped phases no partial."""
    from harness.cli.night import partial_reasons
    from reports.scope import scope_from_nightly

    earlier = {"merged_shards": True, "cases": {"selected": 6, "not_run": 0},
               "shards": {"count": 2, "partition": "p", "merged": ["1-of-2"], "problems": ["shard 2/2 missing (3 cases)"]},
               "fuzz": {"skipped": "run once per night, by shard 1"}, "perf": {"skipped": "run once per night, by shard 1"}}
    scope = scope_from_nightly(earlier)
    assert scope.parts == ["shard 2/2 missing (3 cases)"] and scope.partial
    assert scope.banner().startswith("Incomplete run: shard 2/2 missing (3 cases);")
    assert scope.to_dict()["shards"] == scope.parts  # summary.json keeps the key too
    assert partial_reasons(earlier) == [] == partial_reasons({**earlier, "fuzz": {"skipped": "run once per night, by part 1"}})
