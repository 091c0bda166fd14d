"""The collector: durable per-case appends, resume, cut lines, per-worker files and merging."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, QuantityError, RunInfo
from harness.collect.collector import (
    BadLine,
    ResultWriter,
    merge_results,
    read_records,
    record_full_id,
    run_info,
    worker_results_files,
    worker_results_path,
)

REPO = Path(__file__).resolve().parents[2]
RUN = RunInfo(run_id="r1", host="h", torch_version="2.13.0", backend="gloo")


def make_record(case: CaseConfig, verdict: str = "pass", ratio: float = 0.5) -> CaseRecord:
    errors = [QuantityError("loss", 1e-6, 1e-6, 1e-5, 1.3e-6, verdict == "pass", ratio)]
    return CaseRecord(case=case.to_dict(), case_id=case.case_id, verdict=verdict, errors=errors)


CASES = [
    CaseConfig(),
    CaseConfig(sharding_strategy="shard_grad_op", precision="bf16"),
    CaseConfig(engine="builtin", cpu_offload=True, use_orig_params=True),
]


def test_run_info_describes_this_process() -> None:
    import torch

    info = run_info("gloo")
    assert info.backend == "gloo"
    assert info.torch_version == torch.__version__
    assert info.host
    assert info.run_id and info.run_id != run_info("gloo").run_id, "default run ids must differ"
    assert run_info("gloo", run_id="fixed").run_id == "fixed"
    if not torch.cuda.is_available():
        assert info.gpu is None and info.nccl_version is None
    # This checkout is a git repository: the revision is a 40-hex sha, maybe marked dirty.
    if shutil.which("git") and subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True
    ).returncode == 0:
        assert info.git_rev is not None and len(info.git_rev.split("-")[0]) == 40


def test_append_roundtrips_and_fills_run_and_time(tmp_path: Path) -> None:
    path = tmp_path / "out" / "results.jsonl"
    with ResultWriter(path, RUN) as writer:
        for case in CASES:
            writer.append(make_record(case))
        assert writer.recorded_ids() == {c.full_id for c in CASES}
    records, bad = read_records(path)
    assert bad == []
    assert [r.case_id for r in records] == [c.case_id for c in CASES]
    assert all(r.run == RUN and r.time > 0 for r in records)
    assert records[0].errors[0] == make_record(CASES[0]).errors[0]
    assert path.read_text().count("\n") == len(CASES), "one line per record"


def test_append_keeps_a_record_run_and_time_that_are_set(tmp_path: Path) -> None:
    other = RunInfo(run_id="other", host="x", torch_version="2.11", backend="nccl")
    record = make_record(CASES[0])
    record.run, record.time = other, 123.0
    with ResultWriter(tmp_path / "r.jsonl", RUN) as writer:
        writer.append(record)
    (back,), _ = read_records(tmp_path / "r.jsonl")
    assert back.run == other and back.time == 123.0


def test_every_append_is_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    with ResultWriter(tmp_path / "r.jsonl", RUN) as writer:
        for i, case in enumerate(CASES, start=1):
            writer.append(make_record(case))
            assert len(calls) == i


def test_unserializable_detail_is_written_as_text(tmp_path: Path) -> None:
    record = make_record(CASES[0])
    record.detail = {"log": tmp_path / "rank0.log", "ranks": {1, 0}, "exc": RuntimeError("boom")}
    with ResultWriter(tmp_path / "r.jsonl", RUN) as writer:
        writer.append(record)
    (back,), _ = read_records(tmp_path / "r.jsonl")
    assert back.detail == {"log": str(tmp_path / "rank0.log"), "ranks": [0, 1], "exc": "RuntimeError('boom')"}


def test_killed_process_keeps_every_finished_case(tmp_path: Path) -> None:
    """A SIGKILL right after ``append`` returns loses nothing: the data is on disk, not in a buffer."""
    path = tmp_path / "r.jsonl"
    child = textwrap.dedent(
        f"""
        import os, signal
        from harness.cases.case import CaseConfig
        from harness.cases.records import CaseRecord, RunInfo
        from harness.collect.collector import ResultWriter
        w = ResultWriter({str(path)!r}, RunInfo("k", "h", "t", "gloo"))
        for s in range(3):
            c = CaseConfig(steps=s + 1)
            w.append(CaseRecord(case=c.to_dict(), case_id=c.case_id, verdict="pass"))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    records, bad = read_records(path)
    assert bad == [] and [r.case["steps"] for r in records] == [1, 2, 3]


def test_line_cut_mid_write_is_a_bad_line_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, RUN) as writer:
        writer.append(make_record(CASES[0]))
    full = json.dumps(make_record(CASES[1], "fail").to_dict())
    with open(path, "a") as f:
        f.write(full[: len(full) // 2])  # what a kill in the middle of write() leaves
    records, bad = read_records(path)
    assert len(records) == 1
    assert len(bad) == 1
    assert isinstance(bad[0], BadLine)
    assert bad[0].line == 2 and bad[0].path == str(path)
    assert "not JSON" in bad[0].reason
    assert bad[0].head == full[: len(full) // 2][:200]


def test_other_bad_lines_are_reported_with_reasons(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    newer = make_record(CASES[0]).to_dict() | {"schema": 99}
    wrong_verdict = make_record(CASES[0]).to_dict() | {"verdict": "maybe"}
    path.write_text("\n".join(["[1, 2]", json.dumps(newer), "", json.dumps(wrong_verdict)]) + "\n")
    records, bad = read_records([path])
    assert records == []
    assert [b.line for b in bad] == [1, 2, 4]
    assert "list" in bad[0].reason and "newer" in bad[1].reason and "verdict" in bad[2].reason


def test_a_field_a_newer_writer_added_is_ignored_and_the_record_kept(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, RUN) as writer:
        for case in CASES:
            writer.append(make_record(case))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[0]["from_a_newer_writer"] = 1
    lines[1]["run"]["from_a_newer_writer"] = "x"
    lines[2]["errors"][0]["ulps"] = 3
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    records, bad = read_records(path)
    assert not bad and [r.case_id for r in records] == [c.case_id for c in CASES]
    assert records[1].run == RUN and records[2].errors == make_record(CASES[2]).errors
    # A resume over it skips every recorded case: nothing run twice.
    with ResultWriter(path, RUN, resume=True) as writer:
        assert writer.recorded_ids() == {c.full_id for c in CASES} and not writer.bad_lines


def test_existing_file_needs_resume(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, RUN) as writer:
        writer.append(make_record(CASES[0]))
    with pytest.raises(FileExistsError, match="resume=True"):
        ResultWriter(path, RUN)
    (tmp_path / "empty.jsonl").touch()
    ResultWriter(tmp_path / "empty.jsonl", RUN).close()  # an empty file holds no results


def test_resume_after_a_kill_continues_on_a_fresh_line(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with ResultWriter(path, RUN) as writer:
        writer.append(make_record(CASES[0]))
    cut = json.dumps(make_record(CASES[1]).to_dict())[:40]
    with open(path, "a") as f:
        f.write(cut)
    run2 = RunInfo(run_id="r2", host="h", torch_version="2.13.0", backend="gloo")
    with ResultWriter(path, run2, resume=True) as writer:
        assert writer.recorded_ids() == {CASES[0].full_id}, "the cut case did not finish: run it again"
        assert [b.line for b in writer.bad_lines] == [2]
        writer.append(make_record(CASES[1]))
        assert writer.recorded_ids() == {CASES[0].full_id, CASES[1].full_id}
    records, bad = read_records(path)
    assert [r.case_id for r in records] == [CASES[0].case_id, CASES[1].case_id]
    assert [r.run.run_id for r in records] == ["r1", "r2"]
    assert len(bad) == 1 and bad[0].head == cut


def test_append_after_close_names_the_fix(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path / "r.jsonl", RUN)
    writer.close()
    with pytest.raises(ValueError, match="with"):
        writer.append(make_record(CASES[0]))


def test_record_full_id_survives_a_case_that_no_longer_validates() -> None:
    record = make_record(CASES[0])
    assert record_full_id(record) == CASES[0].full_id
    record.case = record.case | {"precision": "fp8"}
    assert record_full_id(record) == f"torch-fsdp:ddp:{CASES[0].case_id}"


def test_worker_paths_are_per_xdist_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "results.jsonl"
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert worker_results_path(base) == base
    paths = []
    for worker in ("gw10", "gw2", "gw0"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        paths.append(worker_results_path(base))
    assert [p.name for p in paths] == ["results.gw10.jsonl", "results.gw2.jsonl", "results.gw0.jsonl"]
    for p in paths:
        p.touch()
    assert [p.name for p in worker_results_files(base)] == [
        "results.gw0.jsonl", "results.gw2.jsonl", "results.gw10.jsonl"
    ]


def test_concurrent_workers_merge_without_interleaving(tmp_path: Path) -> None:
    """Two real processes write their own worker files at once; the merge holds every record."""
    base = tmp_path / "results.jsonl"
    child = textwrap.dedent(
        f"""
        from harness.cases.case import CaseConfig
        from harness.cases.records import CaseRecord, RunInfo
        from harness.collect.collector import ResultWriter, worker_results_path
        import os
        with ResultWriter(worker_results_path({str(base)!r}), RunInfo("x", "h", "t", "gloo")) as w:
            for s in range(1, 51):
                c = CaseConfig(steps=s, engine="builtin" if os.environ["PYTEST_XDIST_WORKER"] == "gw0" else "torch-fsdp")
                w.append(CaseRecord(case=c.to_dict(), case_id=c.case_id, verdict="pass", detail={{"pad": "x" * 5000}}))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", child], cwd=REPO, env=os.environ | {"PYTEST_XDIST_WORKER": w})
        for w in ("gw0", "gw1")
    ]
    assert [p.wait() for p in procs] == [0, 0]
    files = worker_results_files(base)
    assert len(files) == 2
    # A cut line in one worker's file must survive the merge.
    with open(files[1], "a") as f:
        f.write('{"case": {"engine": "torch-fsdp"')
    assert merge_results(files, base) == 100
    records, bad = read_records(base)
    assert len({record_full_id(r) for r in records}) == 100
    assert len(bad) == 1 and bad[0].line == 101


def test_merge_refuses_to_overwrite_an_input(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="out="):
        merge_results([path], path)
