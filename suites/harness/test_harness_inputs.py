"""Every input of ``python -m harness run|list|nightly`` checked before any case runs, and nothing lost
or hidden after: bad option values, unknown names, a ``--filter`` matching nothing, an ``--out`` that
cannot be a results file, a full disk, a results file another run holds, resumed failures counted
in the exit status, unreadable lines warned about.

Most tests call ``harness.cli.main`` in-process; where a test needs a case recorded without running
ranks it replaces ``harness.run.runner.run_case`` (the pool starts lazily, so no process is spawned):
what is tested is the command line and the collector, the pool has its own suite.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import harness.cli.run as cli_run
from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, RunInfo
from harness.cli import main
from harness.collect.collector import ResultWriteError, ResultWriter, latest_records, read_records
from harness.ranks.placement import RANK_RSS_BYTES, cpu_footprint
from harness.run.runner import Selection, select_cases

ROOT = Path(__file__).resolve().parents[2]
RUN = RunInfo(run_id="earlier", host="h", torch_version="2.13", backend="gloo")
#: a tiny selection: the smoke matrix of one small model, one step.
TINY = ["--matrix", "smoke", "--models", "nested", "--steps", "1", "--no-progress"]


def _cases(limit: int, world_size: int = 2) -> list[CaseConfig]:
    return select_cases(Selection(matrix="smoke", models=["nested"], steps=1, limit=limit), [world_size])


def _record(case: CaseConfig, verdict: str, when: float = 0.0) -> CaseRecord:
    return CaseRecord(case.to_dict(), case.case_id, verdict, reason=f"{verdict} on purpose", time=when)  # type: ignore[arg-type]


def _write(path: Path, records: list[CaseRecord]) -> None:
    with ResultWriter(path, RUN) as writer:
        for record in records:
            writer.append(record)


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------------------------------------------
# option values and names


@pytest.mark.parametrize("option, value", [
    ("--limit", "-1"), ("--limit", "0"), ("--steps", "0"), ("--timeout", "-1"), ("--timeout", "0"),
    ("--world-size", "0"), ("--world-size", "2,-2"), ("--limit", "two"),
])
def test_a_value_that_is_not_positive_is_refused_naming_its_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, value: str
) -> None:
    out = tmp_path / "r.jsonl"
    err = _usage_error(capsys, "run", *TINY, "--out", str(out), f"{option}={value}")
    assert f"argument {option}: must be a positive" in err
    assert not out.exists(), "refused before anything was written"


def test_nightly_refuses_a_timeout_that_is_not_positive(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "argument --timeout: must be a positive" in _usage_error(capsys, "nightly", "--out", str(tmp_path / "n"), "--timeout", "0")


@pytest.mark.parametrize("argv, option", [
    (["nightly", "--time-budget-s", "nan"], "--time-budget-s"), (["nightly", "--time-budget-s", "inf"], "--time-budget-s"),
    (["nightly", "--time-budget-s", "1e300"], "--time-budget-s"), (["run", "--timeout", "1e300"], "--timeout"),
    (["run", "--timeout", "nan"], "--timeout"), (["nightly", "--timeout=-inf"], "--timeout"),
])
def test_seconds_that_are_nan_infinite_or_huge_are_refused_at_parsing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], option: str
) -> None:
    out = tmp_path / "n"
    err = _usage_error(capsys, *argv, "--out", str(out)).strip()
    assert f"argument {option}: must be a " in err and "number of seconds, at most 604800 (a week)" in err
    assert len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("argv", [["run", *TINY], ["nightly"], ["history", "d"], ["certify", "--engine", "builtin"]])
def test_an_empty_out_is_refused_not_taken_for_the_default(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    from reports.__main__ import main as reports_main

    assert "argument --out: must not be empty" in _usage_error(capsys, *argv, "--out", "")
    with pytest.raises(SystemExit) as info:
        reports_main(["build", "r.jsonl", "--out", " "])
    assert info.value.code == 2 and "argument --out: must not be empty" in capsys.readouterr().err


def test_resume_of_an_out_that_does_not_exist_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    typo = tmp_path / "r.jsnol"
    assert main(["run", *TINY, "--limit", "1", "--out", str(typo), "--resume"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--resume: {typo} does not exist" in line and "drop --resume" in line
    assert fake_run_case == [] and not typo.exists() and not Path(f"{typo}.selection.json").exists()
    night = tmp_path / "night"
    assert main(["nightly", "--out", str(night), "--resume", "--matrix", "smoke", "--limit", "1", "--no-progress"]) == 2
    assert f"--resume: {night / 'results.jsonl'} does not exist" in _one_line(capsys.readouterr().err)
    assert not night.exists()


def test_a_repeated_world_size_runs_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--matrix", "smoke", "--world-size", "2,2"]) == 0
    twice = capsys.readouterr().out.split()
    assert main(["list", "--matrix", "smoke", "--world-size", "2"]) == 0
    assert twice == capsys.readouterr().out.split()
    assert len(twice) == len(set(twice))


@pytest.mark.parametrize("option, value", [
    ("--engines", "bogus"), ("--references", "bogus"), ("--models", "bogus"), ("--matrix", "bogus"),
])
@pytest.mark.parametrize("command", ["run", "list"])
def test_an_unknown_name_is_refused_by_its_option(
    capsys: pytest.CaptureFixture[str], command: str, option: str, value: str
) -> None:
    err = _usage_error(capsys, command, option, value)
    assert option in err and "'bogus'" in err and "CaseConfig" not in err


@pytest.mark.parametrize("command", ["run", "list", "nightly"])
def test_a_filter_matching_nothing_exits_2_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     command: str) -> None:
    out = tmp_path / ("n" if command == "nightly" else "r.jsonl")
    extra = ["--out", str(out), "--no-progress"] if command != "list" else []
    err = _usage_error(capsys, command, "--matrix", "smoke", "--filter", "no-such-case", *extra)
    assert "--filter 'no-such-case' matches none of the" in err
    assert not (out / "results.jsonl").exists() and not out.is_file()


# ---------------------------------------------------------------------------------------------------
# --out


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("where", ["proc", "sys", "below a file", "a directory"])
def test_an_out_that_cannot_be_a_results_file_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str], where: str
) -> None:
    (tmp_path / "file").write_text("x")
    out = {"proc": "/proc/results.jsonl", "sys": "/sys/kernel/results.jsonl",
           "below a file": str(tmp_path / "file" / "results.jsonl"), "a directory": str(tmp_path)}[where]
    assert main(["run", *TINY, "--limit", "1", "--out", out]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("harness run: --out") and "Traceback" not in line
    assert {"proc": "under /proc", "sys": "under /sys", "below a file": "is a file",
            "a directory": "is a directory"}[where] in line
    assert fake_run_case == [], "refused before any case ran"


def test_nightly_out_naming_a_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.write_text("not a directory")
    assert main(["nightly", "--out", str(out), "--matrix", "smoke", "--limit", "1", "--fuzz-profile", "none"]) == 2
    assert "--out" in _one_line(capsys.readouterr().err) and out.read_text() == "not a directory"


class _FullDisk:
    """A results file on a disk that fills after ``room`` writes (the writes before are real)."""

    def __init__(self, file: Any, room: int) -> None:
        self.file, self.room = file, room

    def write(self, text: str) -> int:
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return int(self.file.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def test_a_full_disk_raises_naming_the_file_and_keeps_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    cases = _cases(3)
    writer = ResultWriter(path, RUN)
    writer._file = _FullDisk(writer._file, room=2)  # type: ignore[assignment]
    writer.append(_record(cases[0], "pass"))
    writer.append(_record(cases[1], "fail"))
    with pytest.raises(ResultWriteError, match=f"{path}.*No space left"):
        writer.append(_record(cases[2], "pass"))
    writer.close()
    records, bad = read_records(path)
    assert [r.case_id for r in records] == [cases[0].case_id, cases[1].case_id] and not bad


def test_run_on_a_full_disk_stops_loudly_with_exit_2(
    capsys: pytest.CaptureFixture[str], fake_run_case: list[str]
) -> None:
    assert main(["run", *TINY, "--limit", "2", "--out", "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "/dev/full" in err and "No space left on device" in err and "Traceback" not in err
    assert len(fake_run_case) == 1, "the run stopped at the first record it could not write"


# ---------------------------------------------------------------------------------------------------
# resume


def test_resume_exits_by_every_record_in_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    cases = _cases(4)
    out = tmp_path / "r.jsonl"
    _write(out, [_record(c, v) for c, v in zip(cases, ("crash", "timeout", "fail", "error"))])
    before = out.read_text()
    assert main(["run", *TINY, "--limit", "4", "--out", str(out), "--resume"]) == 1
    captured = capsys.readouterr()
    assert fake_run_case == [] and out.read_text() == before, "nothing rerun, nothing lost or added"
    assert f"{out} holds 4 cases" in captured.out and "--rerun-failed" in captured.out


def test_rerun_failed_reruns_the_cases_not_passing_and_supersedes_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    from reports.api import load

    cases = _cases(4)
    out = tmp_path / "r.jsonl"
    _write(out, [_record(c, v, when=1.0) for c, v in zip(cases, ("pass", "crash", "unsupported", "fail"))])
    assert main(["run", *TINY, "--limit", "4", "--out", str(out), "--rerun-failed"]) == 0
    assert fake_run_case == [cases[1].full_id, cases[3].full_id]
    records, bad = read_records(out)
    assert len(records) == 6 and not bad, "the old records stay; the new ones follow"
    latest = latest_records(records)
    assert {i: r.verdict for i, r in latest.items()} == {
        cases[0].full_id: "pass", cases[1].full_id: "pass", cases[2].full_id: "unsupported", cases[3].full_id: "pass"}
    # The reports pick the same latest record of each case.
    loaded = load(out)
    assert loaded.superseded == 2
    assert dict(zip(loaded.frame["full_id"], loaded.frame["verdict"])) == {i: r.verdict for i, r in latest.items()}
    assert "cases/s" in capsys.readouterr().out


def test_resume_warns_of_each_unreadable_line_like_the_reports_and_counts_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    from reports.__main__ import main as reports_main

    case = _cases(1)[0]
    out = tmp_path / "r.jsonl"
    _write(out, [_record(case, "pass")])
    with open(out, "a") as f:
        f.write('{"case": {"engine"\n')
    assert main(["run", *TINY, "--limit", "1", "--out", str(out), "--resume"]) == 0
    run_err = capsys.readouterr().err
    warning = f"warning: unreadable line {out}:2: not JSON"
    assert warning in run_err and f"1 unreadable line(s) in {out}" in run_err.splitlines()[-1]
    assert reports_main(["build", str(out), "--out", str(tmp_path / "report")]) == 0
    assert warning in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# one run per results file


def test_a_second_run_on_the_same_out_refuses_naming_the_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    out = tmp_path / "r.jsonl"
    with ResultWriter(out, RUN):
        assert main(["run", *TINY, "--limit", "1", "--out", str(out), "--resume"]) == 2
        line = _one_line(capsys.readouterr().err)
        assert "--out" in line and f"pid {os.getpid()} started" in line
    assert fake_run_case == [] and out.read_text() == ""
    assert not (tmp_path / "r.jsonl.lock").exists(), "the owner note goes with the run"
    assert main(["run", *TINY, "--limit", "1", "--out", str(out), "--resume"]) == 0
    assert len(read_records(out)[0]) == 1


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom harness.collect.collector import ResultWriter\n"
         "from harness.cases.records import RunInfo\n"
         f"w = ResultWriter({str(out)!r}, RunInfo('k', 'h', 't', 'gloo'))\nprint('held', flush=True)\ntime.sleep(600)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"pid {holder.pid} started"):
            ResultWriter(out, RUN, resume=True)
    finally:
        holder.kill()
        holder.wait()
    assert f"pid {holder.pid}" in (tmp_path / "r.jsonl.lock").read_text(), "kill -9 leaves the note"
    with ResultWriter(out, RUN, resume=True) as writer:  # the kernel dropped the flock: the note is stale
        writer.append(_record(_cases(1)[0], "pass"))
        assert f"pid {os.getpid()}" in (tmp_path / "r.jsonl.lock").read_text()
    assert len(read_records(out)[0]) == 1


# ---------------------------------------------------------------------------------------------------
# the machine


def test_nccl_without_gpus_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without GPUs (CUDA is available here)")
    out = tmp_path / "r.jsonl"
    assert main(["run", *TINY, "--limit", "1", "--backend", "nccl", "--out", str(out)]) == 2
    assert "--backend nccl needs a CUDA GPU" in _one_line(capsys.readouterr().err)
    assert not out.exists()


def test_the_footprint_of_many_cpu_ranks() -> None:
    big = cpu_footprint([2, 64], cores=2, available_bytes=8 * 2**30)
    assert big.ranks == 64 and big.bytes == 64 * RANK_RSS_BYTES and big.oversubscribed
    assert "64 rank processes on 2 CPU core(s)" in big.describe() and "25.0 GiB" in big.describe()
    assert not cpu_footprint([2], cores=2, available_bytes=8 * 2**30).oversubscribed
    assert cpu_footprint([4], cores=2, available_bytes=None).oversubscribed  # more ranks than cores


def test_many_ranks_on_few_cores_warn_before_starting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_run_case: list[str]
) -> None:
    import harness.ranks.placement

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(harness.ranks.placement, "available_memory", lambda: 64 * RANK_RSS_BYTES)  # fits: a warning
    cases = _cases(1, world_size=64)
    out = tmp_path / "r.jsonl"
    _write(out, [_record(cases[0], "pass")])  # already recorded: nothing starts 64 ranks here
    argv = ["run", *TINY, "--limit", "1", "--world-size", "64", "--device", "cpu", "--out", str(out), "--resume"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: --world-size 64 on CPU takes 64 rank processes on 2 CPU core(s)" in err and "GiB of memory" in err
    # More memory than is free: refused in one line before any rank starts, not a warning and then tracebacks.
    monkeypatch.setattr(harness.ranks.placement, "available_memory", lambda: 23 * 2**30)
    before = out.read_text()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more memory than is free; lower --world-size" in err and "23.0 GiB available" in err
    assert fake_run_case == [] and out.read_text() == before


# ---------------------------------------------------------------------------------------------------
# unreadable bytes


def test_control_characters_never_reach_a_report_raw(tmp_path: Path) -> None:
    from reports.__main__ import main as reports_main

    cases = _cases(2)
    out = tmp_path / "r.jsonl"
    _write(out, [CaseRecord(cases[0].to_dict(), cases[0].case_id, "fail", reason="bad\x00byte\x1b[31m")])
    with open(out, "ab") as f:
        f.write(json.dumps(_record(cases[1], "pass").to_dict()).encode()[:60] + b"\x00\x07garbage\n")
    records, bad = read_records(out)
    assert records[0].reason == "bad\\x00byte\\x1b[31m"
    assert "\x00" not in bad[0].head and "\\x00\\x07garbage" in bad[0].head
    assert reports_main(["build", str(out), "--out", str(tmp_path / "report")]) == 0
    for name in ("matrix.md", "matrix.html", "results.csv"):
        text = (tmp_path / "report" / name).read_text(encoding="utf-8")
        assert "\x00" not in text and "\x1b" not in text and "\x07" not in text, name


def test_a_report_of_no_readable_record_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from reports.__main__ import main as reports_main

    out = tmp_path / "r.jsonl"
    out.write_text('{"cut": \n')
    assert reports_main(["build", str(out), "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert "no readable record" in err and f"(1 unreadable line(s), the first {out}:1: not JSON" in err
    assert not (tmp_path / "report").exists()
    # A file that is no results file: the one line, with the count, not a warning per line first.
    readme = ROOT / "README.md"
    assert reports_main(["build", str(readme), "--out", str(tmp_path / "report")]) == 2
    lines = sum(1 for line in readme.read_text().splitlines() if line.strip())
    assert f"({lines} unreadable line(s), the first {readme}:1:" in _one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------------
# the rank a hang names (pure; the pool suite runs the real hang)


def _dump(*frames: str) -> str:
    """A faulthandler dump of the main thread, innermost frame first."""
    return "Current thread 0x01 (most recent call first):\n" + "".join(f'  File "{f}\n' for f in frames)


WAITING = _dump('/site/torch/distributed/distributed_c10d.py", line 2800 in all_gather_into_tensor',
                '/repo/harness/compare/parity.py", line 10 in run_case_on_rank')
IN_BACKWARD = _dump('/site/torch/autograd/graph.py", line 800 in _engine_run_backward',
                    '/repo/harness/compare/parity.py", line 12 in train')
STUCK = _dump('/repo/harness/compare/parity.py", line 300 in _hang_in_forward',
              '/site/torch/nn/modules/module.py", line 1700 in _call_impl')


@pytest.mark.parametrize("stacks, behind", [
    ({0: WAITING, 1: STUCK}, [1]),
    ({0: STUCK, 1: IN_BACKWARD}, [0]),
    ({0: WAITING, 1: STUCK, 2: STUCK}, [1, 2]),
    ({0: WAITING, 1: WAITING}, []),  # mismatched collectives: nobody is behind
    ({0: STUCK, 1: STUCK}, []),  # all hang outside collectives
    ({0: WAITING, 1: ""}, []),  # no stack: no claim
])
def test_the_rank_behind_is_the_one_not_waiting_in_a_collective(stacks: dict[int, str], behind: list[int]) -> None:
    from harness.ranks.stacks import behind_ranks, timeout_reason

    assert behind_ranks(sorted(stacks), stacks) == behind
    reason = timeout_reason(sorted(stacks), stacks, 5.0)
    if behind:
        assert f"rank {behind[0]} is behind, at parity.py:300 in _hang_in_forward" in reason
    else:
        assert "behind" not in reason and "rank 0 at" in reason


def test_stacks_and_tracebacks_name_no_machine_directory() -> None:
    import torch

    import harness.compare.parity
    from harness.ranks.stacks import local_prefixes, portable_paths

    table = {"/site/": "<site-packages>/", "/repo/": ""}
    assert '"harness/compare/parity.py", line 300 in _hang_in_forward' in portable_paths(STUCK, table)
    assert "/site/" not in portable_paths(WAITING, table) and "<site-packages>/torch/distributed" in portable_paths(WAITING, table)
    # The longest prefix first: the installed packages lie inside the standard library's directory.
    nested = {"/py/lib/": "<stdlib>/", "/py/lib/site-packages/": "<site-packages>/"}
    assert portable_paths("/py/lib/site-packages/torch/x.py /py/lib/os.py", nested) == "<site-packages>/torch/x.py <stdlib>/os.py"
    here = f'File "{harness.compare.parity.__file__}", line 1 in f\nFile "{torch.__file__}", line 2 in g'
    assert portable_paths(here) == 'File "harness/compare/parity.py", line 1 in f\nFile "<site-packages>/torch/__init__.py", line 2 in g'
    assert all(prefix.startswith("/") or ":" in prefix for prefix in local_prefixes())


def test_the_nightly_runner_stops_at_a_write_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import harness.run.runner as runner
    from harness.ranks.placement import Lane

    monkeypatch.setattr(runner, "run_case", lambda pool, case: _record(case, "pass"))
    cases = _cases(3)
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, RUN) as writer:
        writer._file = _FullDisk(writer._file, room=1)  # type: ignore[assignment]
        progress = runner.Progress(len(cases), enabled=False)
        case_runner = runner.CaseRunner(writer, progress, deadline=None, case_timeout_s=5.0)
        with pytest.raises(ResultWriteError, match=str(path)):
            case_runner.run([Lane(2, "gloo", None)], cases)
    assert case_runner.recorded == 1 and [r.case_id for r in read_records(path)[0]] == [cases[0].case_id]


@pytest.mark.parametrize("argv, needle", [
    (["list", "--engines", ""], "--engines: must name at least one value"),
    (["list", "--models", " , "], "--models: must name at least one value"),
    (["list", "--filter", ""], "--filter: must not be empty"),
    (["list", "--references", ""], "--references: must name at least one value"),
    (["nightly", "--out", "x", "--engines", ""], "--engines: must name at least one value"),
    (["run", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_an_empty_value_or_option_error_is_one_line_not_all(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    err = _usage_error(capsys, *argv).strip()
    assert needle in err and len(err.splitlines()) == 1 and "usage:" not in err and "(--help for usage)" in err


@pytest.mark.parametrize("when", ["mid-run", "after the last case", "replaced"])
def test_a_results_file_deleted_under_the_run_is_noticed_with_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, when: str
) -> None:
    import harness.run.runner as runner

    out = tmp_path / "del.jsonl"
    ran: list[str] = []

    def run_case(pool: Any, case: CaseConfig, timeout_s: float | None = None) -> CaseRecord:
        ran.append(case.full_id)
        if len(ran) == (1 if when == "mid-run" else 3):
            if when == "replaced":  # atomically, as editors save: another lane (GPU nodes) never sees no file
                (tmp_path / "other.jsonl").write_text("")
                os.replace(tmp_path / "other.jsonl", out)
            else:
                out.unlink()
        return _record(case, "pass", when=time.time())

    monkeypatch.setattr(runner, "run_case", run_case)
    assert main(["run", *TINY, "--limit", "3", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    line = captured.err.strip().splitlines()[-1]
    assert f"--out: {out} was {'replaced by another file' if when == 'replaced' else 'deleted'} while this run wrote it" in line
    assert "cases ->" not in captured.out and "--resume" not in line, "no summary of a file that is gone, no resume of it"
    assert len(ran) == (1 if when == "mid-run" else 3)


@pytest.mark.parametrize("front, argv", [
    *(("harness", argv) for argv in ([], ["run"], ["nightly"], ["certify"], ["history"], ["perf"])),
    ("reports", []), ("reports", ["build"]), ("reports", ["diff"]),
])
def test_help_texts_show_no_backticks(capsys: pytest.CaptureFixture[str], front: str, argv: list[str]) -> None:
    from reports.__main__ import main as reports_main

    with pytest.raises(SystemExit) as info:
        (main if front == "harness" else reports_main)([*argv, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "usage:" in out and "`" not in out


def test_certify_into_a_disk_that_fills_is_one_line_and_writes_no_half_certificate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import harness.cli.certify as certify

    out = tmp_path / "cert"
    quick = ["certify", "--engine", "builtin", "--families", "torch-common-fsdp", "--device", "cpu", "--no-progress"]
    real = certify.to_json

    def full(cert: Any) -> str:  # the disk fills at the last file
        real(cert)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "certificate.json"))

    monkeypatch.setattr(certify, "to_json", full)
    assert main([*quick, "--out", str(out)]) == 2
    line = _one_line(capsys.readouterr().err.replace("certify builtin: torch-common-fsdp ...", ""))
    assert line.startswith(f"harness certify: cannot write the certificate into {out}: No space left on device")
    assert not list(out.glob("certificate.*")), "no certificate.md without its .json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cert"], "no staging directory left"
    (tmp_path / "file").write_text("x")
    assert main([*quick, "--out", str(tmp_path / "file" / "cert")]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"harness certify: --out {tmp_path / 'file' / 'cert'}: ")
