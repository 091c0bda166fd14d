"""The one options model (``harness.run.options``) both front ends register from, and the one run session
(``harness.run.session``) every command runs its cases through: the same names, aliases, checks and messages
on the command line and in pytest; a session's explicit state over a results file (fake ranks)."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.cli import main
from harness.collect.collector import ResultWriter, RunInfo, read_records
from harness.pytest_plugin.cases import ParityOptions
from harness.ranks.placement import Lane
from harness.run.options import SelectionOptions, as_typed, option_specs
from harness.run.runner import Selection
from harness.run.session import RunSession, select_part

REPO = Path(__file__).resolve().parents[2]
RUN = RunInfo("test", "host", "0", "gloo")


# ---------------------------------------------------------------------------------------------------
# the options model


def test_pytest_offers_the_command_line_options_under_the_same_names() -> None:
    cli = {s.field: s for s in option_specs("cli")}
    for spec in option_specs("pytest"):
        assert cli[spec.field].flag == spec.flag
        # pytest-timeout owns pytest's --timeout: the one alias the plugin leaves out.
        assert set(cli[spec.field].aliases_for("cli")) - set(spec.aliases_for("pytest")) <= {"--timeout"}
    assert {s.flag: s.aliases for s in option_specs("pytest") if s.aliases} == {
        "--engines": ("--engine",), "--references": ("--reference",), "--case-timeout": ("--timeout",)}


@pytest.mark.parametrize("field, flag, value", [
    ("engines", "--engines", ""), ("references", "--references", "ddp,ddp"), ("world_sizes", "--world-size", "0"),
    ("case_timeout_s", "--case-timeout", "nan"), ("steps", "--steps", "two"),
])
def test_a_bad_value_has_one_message_on_the_command_line_and_in_pytest(
    capsys: pytest.CaptureFixture[str], field: str, flag: str, value: str
) -> None:
    with pytest.raises(ValueError) as info:
        SelectionOptions.parse({field: value}, front="cli")
    message = str(info.value)
    assert message.startswith(f"{flag}: ")
    command = "run" if field == "case_timeout_s" else "list"
    with pytest.raises(SystemExit):
        main([command, f"{flag}={value}"])
    assert f"argument {message}" in capsys.readouterr().err, "argparse says the same after 'argument'"


def test_the_old_spellings_select_what_the_new_ones_do(capsys: pytest.CaptureFixture[str]) -> None:
    def listed(*argv: str) -> list[str]:
        assert main(["list", "--matrix", "smoke", *argv]) == 0
        return capsys.readouterr().out.split()

    assert listed("--engine", "torch-fsdp", "--reference", "ddp") == listed("--engines", "torch-fsdp", "--references", "ddp")
    old = ParityOptions.parse(engine="torch-fsdp", reference="ddp", matrix="smoke", world_size="2", backend="auto",
                              case_timeout="60", results=None)
    assert old.engines == ("torch-fsdp",) and old.references == ("ddp",) and old.case_timeout_s == 60.0


def test_an_error_names_the_option_as_it_was_typed(capsys: pytest.CaptureFixture[str]) -> None:
    for typed in ("--engine", "--engines"):
        with pytest.raises(SystemExit):
            main(["list", typed, "bogus"])
        assert f"{typed}: engine 'bogus' is not registered" in capsys.readouterr().err
    assert as_typed("--engines: x", ["--engine=a"]) == "--engine: x"
    assert as_typed("--case-timeout: x", ["--timeout", "0"]) == "--timeout: x"
    assert as_typed("--case-timeout: x", ["--timeout", "0"], "pytest") == "--case-timeout: x", "not pytest's --timeout"
    assert as_typed("--resume: x", ["--engine", "a"]) == "--resume: x"
    with pytest.raises(SystemExit):
        main(["run", "--timeout", "0"])
    assert "argument --timeout: must be a positive" in capsys.readouterr().err


def test_the_options_are_frozen_and_make_the_selection() -> None:
    options = SelectionOptions(engines=["builtin"], loop_axes=True, stress=True, filters=["a+b"])
    assert options.engines == ("builtin",) and options.filters == ("a+b",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.matrix = "full"  # type: ignore[misc]
    selection = options.selection()
    assert isinstance(selection, Selection) and selection.engines == ["builtin"] and selection.stress == "delay"
    assert set(selection.loop_axes) == {"clip_grad", "grad_accum", "activation_checkpointing", "compile"}
    assert selection.optimizers and len(selection.optimizers) > 1, "--loop-axes widens the optimizers too"
    assert SelectionOptions(clip_grad=("norm",), loop_axes=True).selection().loop_axes["clip_grad"] == ["norm"]


def test_the_library_reads_no_argparse_namespace() -> None:
    library = [p for p in (REPO / "harness").rglob("*.py") if "cli" not in p.relative_to(REPO / "harness").parts]
    readers = [str(p.relative_to(REPO)) for p in library
               if re.search(r"argparse\.Namespace|from_args\(|getattr\(args", p.read_text(encoding="utf-8"))]
    assert readers == []


# ---------------------------------------------------------------------------------------------------
# the run session


def _cases(n: int) -> list[CaseConfig]:
    return [CaseConfig(engine="builtin", steps=s) for s in range(2, 2 + n)]


def _record(case: CaseConfig, verdict: str) -> CaseRecord:
    return CaseRecord(case.to_dict(), case.case_id, verdict, reason=verdict, time=time.time())  # type: ignore[arg-type]


def test_a_session_runs_what_the_file_lacks_and_keeps_the_latest_record(
    tmp_path: Path, fake_run_case: list[str]
) -> None:
    cases = _cases(3)
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, RUN) as writer:
        writer.append(_record(cases[0], "pass"))
        writer.append(_record(cases[1], "fail"))
    lanes = {2: [Lane(2, "gloo", None)]}
    with RunSession(ResultWriter(path, RUN, resume=True), lanes, case_timeout_s=5.0, show_progress=False) as session:
        assert [c.full_id for c in session.todo(cases)] == [cases[2].full_id]
        assert session.reruns(True) == {cases[1].full_id} and session.reruns(False) == set()
        todo = session.todo(cases, rerun_failed=True)
        assert [c.full_id for c in todo] == [cases[1].full_id, cases[2].full_id]
        session.run(todo)
    assert fake_run_case == [c.full_id for c in todo]
    assert [r.case_id for r in session.records] == [c.case_id for c in todo] and session.recorded == 2
    assert {r.verdict for r in session.latest.values()} == {"pass"} and len(session.latest) == 3
    assert not session.not_run and not session.pools_failed and not session.interrupted
    assert session.progress is not None and session.progress.counts == {"pass": 2}
    assert len(read_records(path)[0]) == 4 and writer.path == path


def test_a_session_stops_every_lane_on_ctrl_c_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.run.runner as runner

    def interrupted(pool: Any, case: CaseConfig, timeout_s: float | None = None) -> CaseRecord:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.CaseRunner, "run_all", lambda self, lanes, cases, budget_s=None: interrupted(None, cases[0]))
    with RunSession(ResultWriter(tmp_path / "r.jsonl", RUN), {2: [Lane(2, "gloo", None)]}, case_timeout_s=5.0,
                    show_progress=False, interrupt_wait_s=0) as session:
        with pytest.raises(KeyboardInterrupt):
            session.run(_cases(1))
    assert session.interrupted and session.runner is not None and session.runner.stop.is_set()
    assert session.progress is not None and session.progress.bar.disable


def test_a_part_is_the_shard_and_stores_the_selection(tmp_path: Path) -> None:
    selection = Selection(matrix="smoke", engines=["torch-fsdp"], references=["local"])
    whole = select_part(selection, [2])
    halves = [select_part(selection, [2], part=f"{k}/2") for k in (1, 2)]
    assert whole.cut is None and whole.cases == whole.selected and whole.describe() == ""
    assert sorted(c.full_id for h in halves for c in h.cases) == sorted(c.full_id for c in whole.cases)
    assert {h.id for h in halves} == {whole.id}, "every shard shares the selection's id"
    assert halves[0].describe().startswith(f"part 1/2 of {len(whole.selected)} cases")
    out = tmp_path / "r.jsonl"
    out.write_text("")
    stored = halves[1].store(out)
    assert stored.part is not None and stored.part["index"] == 1
    resumed = select_part(selection, [2], stored=stored)
    assert resumed.cases == halves[1].cases and resumed.store(out) is stored
