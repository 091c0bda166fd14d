"""``python -m harness nightly`` end to end on CPU with a tiny selection: every product in the out
directory, the diff against a previous nightly deciding the exit status, the time budget, and a
killed nightly resumed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, RunInfo, parse_not_run
from harness.cli import main
from harness.cli.fuzz import report_reserve
from harness.collect.breakdown import ROWS
from harness.collect.collector import ResultWriter, read_records
from harness.compare.phases import PHASES, before_job_s
from harness.pytest_plugin import needs_gpus
from harness.ranks.mps import CONTROL
from harness.ranks.placement import n_gpus
from harness.run.runner import Selection, select_cases
from harness.run.stored_selection import StoredSelection, selection_options

ROOT = Path(__file__).resolve().parents[2]
#: the tiny selection the CPU tests run: smoke cases of torch FSDP1 against the local reference.
# Pairwise's NO_SHARD cases of torch FSDP1 against local: 7, one of them with CPU offload, which torch FSDP1
# refuses on CPU ranks (unsupported; the smoke selection holds no such case any more).
TINY = ("--matrix", "pairwise", "--engines", "torch-fsdp", "--references", "local", "--filter", "no_shard", "--no-progress")
TINY_SELECTION = dict(matrix="pairwise", engines=["torch-fsdp"], references=["local"], filters=["no_shard"])


def _env(gpus: bool = False) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _nightly(*args: str, timeout: float = 240, gpus: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", "nightly", *args], cwd=ROOT, env=_env(gpus),
                          capture_output=True, text=True, timeout=timeout)


def _tiny_cases() -> list[CaseConfig]:
    return select_cases(Selection(**TINY_SELECTION), [2])


def _write_results(path: Path, records: list[CaseRecord], nightly: bool = True) -> None:
    with ResultWriter(path, RunInfo("earlier", "host", torch.__version__, "gloo")) as writer:
        for record in records:
            writer.append(record)
    if nightly:  # what marks a directory as a nightly of TINY's selection (find_previous)
        (path.parent / "nightly.json").write_text(json.dumps({"selection": {"id": _tiny_selection().id}}))


def _tiny_selection() -> StoredSelection:
    selection = Selection(**TINY_SELECTION)
    return StoredSelection(selection_options(selection, [2]), tuple(c.full_id for c in _tiny_cases()))


def test_nightly_writes_every_product_and_a_regression_fails_it(tmp_path: Path) -> None:
    # torch FSDP1 refuses CPU offload on a CPU rank (unsupported): a previous nightly where that case
    # passed makes this one a "pass -> unsupported" regression.
    offload = next(c for c in _tiny_cases() if c.cpu_offload)
    previous = tmp_path / "2026-01-01"
    _write_results(previous / "results.jsonl", [CaseRecord(offload.to_dict(), offload.case_id, "pass")])
    later = tmp_path / "2026-01-03"  # sorts after this nightly: must not be the baseline
    _write_results(later / "results.jsonl", [CaseRecord(offload.to_dict(), offload.case_id, "unsupported")])
    # Results of `harness run` next to the nightlies, newer than the baseline: not a nightly.
    _write_results(tmp_path / "2026-01-01b" / "results.jsonl", [CaseRecord(offload.to_dict(), offload.case_id, "unsupported")],
                   nightly=False)
    # A night of another selection, newer than the baseline: nights compare with their own selection only.
    _write_results(tmp_path / "2026-01-01c" / "results.jsonl", [CaseRecord(offload.to_dict(), offload.case_id, "unsupported")])
    (tmp_path / "2026-01-01c" / "nightly.json").write_text(json.dumps({"selection": {"id": "another"}}))
    out = tmp_path / "2026-01-02"

    done = _nightly("--out", str(out), *TINY, "--fuzz-max-examples", "20")
    assert done.returncode == 1, done.stdout + done.stderr

    for name in ("results.jsonl", "fuzz.txt", "matrix.md", "matrix.html", "results.csv", "summary.json",
                 "diff.md", "diff.json", "nightly.json"):
        assert (out / name).is_file(), name
    assert not (out / "not_run.txt").exists()
    records, bad = read_records(out / "results.jsonl")
    assert not bad and len(records) == len(_tiny_cases())
    state = json.loads((out / "nightly.json").read_text())
    assert state["complete"] and state["exit_code"] == 1 and state["selection"]["id"] == _tiny_selection().id
    assert state["cases"]["selected"] == state["cases"]["recorded"] == len(records) and state["cases"]["not_run"] == 0
    counts = {v: sum(r.verdict == v for r in records) for v in state["verdicts"]}
    assert state["verdicts"] == counts and counts["unsupported"] == 1
    assert state["exit_reasons"] == ["1 regression(s) against the previous nightly"]

    diff = json.loads((out / "diff.json").read_text())
    assert state["diff"]["previous"] == str(previous / "results.jsonl")
    [regression] = [c for c in diff["changes"] if c["kind"] == "regression"]
    assert regression["full_id"] == offload.full_id and regression["what"] == "pass → unsupported"
    assert "Regressions (1)" in (out / "diff.md").read_text()

    fuzz = state["fuzz"]
    assert fuzz["exit_code"] == 0 and fuzz["max_examples"] == 20
    assert fuzz["examples"] >= 20 and fuzz["examples_per_s"] > 0
    assert "examples/s" in (out / "fuzz.txt").read_text()
    assert "nightly" in done.stdout and "regression" in done.stdout and "cases/s" in done.stdout
    assert state["cases"]["cases_per_s"] > 0 and state["cases"]["order"] == "generator"
    # Where the cases' time went (issue 39): every phase of every case, the busiest rank's, within the case's
    # round trip (the parent's clock and the ranks' read a hair apart).
    breakdown = state["cases"]["breakdown"]
    assert breakdown["cases"] == len(records) and list(breakdown["rows"]) == list(ROWS)
    for record in records:
        assert list(record.detail["phases_s"]) == list(PHASES) and record.detail["handoff_s"] >= 0
        assert sum(record.detail["phases_s"].values()) <= record.wall_s + 1e-3, (record.case_id, record.detail)
        if record.verdict in ("pass", "fail"):  # trained: its reads of the engine are timed apart from its steps
            assert record.detail["phases_s"]["observe"] > 0 and record.detail["phases_s"]["steps"] > 0, record.detail
    assert state["cases"]["host"]["samples"] >= 1 and "handoff" in done.stdout and "host (" in done.stdout
    # CPU ranks: no CUDA MPS wanted, and the summary says so (harness.ranks.mps).
    assert state["cases"]["mps"] == {"active": False, "how": "off: no rank of this run is on a GPU", "wanted": False}
    assert "CUDA MPS: off: no rank of this run is on a GPU" in done.stdout
    # The determinism sample: one case per engine and strategy checked, none nondeterministic.
    strategies = {c.sharding_strategy for c in _tiny_cases() if not c.cpu_offload}
    assert set(state["determinism"]["configurations"]) >= {f"torch-fsdp/{s}" for s in strategies}
    assert state["determinism"]["nondeterministic"] == [] and "determinism:" in done.stdout
    # On CPU the performance section is a smoke check: measured, labelled, never compared.
    assert state["perf"]["kind"] == "smoke" and set(state["perf"]["smoke"]) == {"builtin/full_shard", "torch-fsdp/full_shard"}
    assert state["perf_diff"]["compared"] is False and "smoke" in done.stdout

    # Resumed after it finished: nothing to run again, the finished campaign is kept, the verdict stands.
    again = _nightly("--out", str(out), *TINY, "--fuzz-max-examples", "20", "--resume")
    assert again.returncode == 1, again.stdout + again.stderr
    state = json.loads((out / "nightly.json").read_text())
    assert state["cases"]["already_recorded"] == len(records) and state["cases"]["recorded"] == 0
    assert state["fuzz"]["resumed_from_earlier_attempt"] and state["fuzz"]["examples"] == fuzz["examples"]
    assert len(read_records(out / "results.jsonl")[0]) == len(records)


def test_the_time_budget_holds_the_whole_nightly_report_included(tmp_path: Path) -> None:
    """More cases than fit: the nightly, its report and case pages included, ends within its budget (plus
    the one case running when the budget runs out), and says what it left out."""
    # A wait, not a measured quantity: on a quiet two-core machine 6 s records ~60 cases (the pool is up in
    # ~2 s) and leaves ~2,450 not run, so both sides of the budget are exercised; the bound below is the check.
    # CUDA ranks take longer to start, more so beside 16 pytest-xdist workers: 12 s there.
    budget = 12.0 if torch.cuda.is_available() else 6.0
    out = tmp_path / "budget"
    done = _nightly("--out", str(out), "--matrix", "full", "--engines", "builtin", "--models", "nested", "--no-progress",
                    "--fuzz-profile", "none", "--no-perf", "--time-budget-s", str(budget), timeout=240)
    state = json.loads((out / "nightly.json").read_text())
    assert state["cases"]["recorded"] > 0 and state["cases"]["not_run"] > 0, done.stdout + done.stderr
    # A case's time in the nightly includes what it waited for before its job was sent, which its wall time leaves
    # out: its pool's start (a lane taking its first case just before the deadline starts its pool then: seconds
    # of CUDA set-up on a loaded node) and its GPU slots (under a pytest-xdist run on GPUs).
    slowest = max(r.wall_s + before_job_s(r.detail) for r in read_records(out / "results.jsonl")[0])
    # The report's reserve is an estimate: on a loaded node (16 pytest-xdist workers beside it) the report
    # outran it. What the budget promises is that no case starts after its deadline, so the report's own
    # overrun beyond the reserve is allowed for, and the cases' part is held to the second.
    overrun = max(state["report"]["wall_s"] - report_reserve(budget), 0.0)
    # The pools close after their last cases, past the deadline: a second on CPU ranks, seconds of CUDA and
    # NCCL teardown on a loaded GPU node; the nightly counts that time (``pools_close_s``) and so does the bound.
    closing = state["cases"]["pools_close_s"]
    assert state["wall_s"] <= budget + slowest + closing + overrun + 2.0, \
        (state["wall_s"], slowest, closing, overrun, state["cases"]["wall_s"], state["report"]["wall_s"])
    assert (out / "matrix.html").is_file() and "nightly ok" not in done.stdout


def test_a_spent_time_budget_lists_every_case_not_run(tmp_path: Path) -> None:
    cases = _tiny_cases()
    elsewhere = tmp_path / "baselines" / "last-week"  # --previous: any nightly, not only a sibling
    _write_results(elsewhere / "results.jsonl", [CaseRecord(cases[0].to_dict(), cases[0].case_id, "pass")])
    out = tmp_path / "budget"
    done = _nightly("--out", str(out), *TINY, "--time-budget-s", "0", "--previous", str(elsewhere))
    assert done.returncode == 1, done.stdout + done.stderr  # nothing ran: never a green nightly
    assert "no case was run" in done.stdout and "nightly ok" not in done.stdout
    assert json.loads((out / "nightly.json").read_text())["cases"]["order"] == "sampled"
    listed = parse_not_run((out / "not_run.txt").read_text())
    assert sorted(n.full_id for n in listed) == sorted(c.full_id for c in cases)
    assert all("time budget" in n.why and CaseConfig.from_dict(n.case).full_id == n.full_id for n in listed)
    state = json.loads((out / "nightly.json").read_text())
    assert state["cases"]["not_run"] == len(cases) and state["cases"]["recorded"] == 0
    # The budget covers the fuzz campaign too: none of it is left.
    assert state["fuzz"]["skipped"] == "time budget of 0 s spent by the cases" and not (out / "fuzz.txt").exists()
    assert state["fuzz"]["time_budget_s"] == 0
    assert sum(state["verdicts"].values()) == 0 and (out / "matrix.md").is_file()
    assert f"{len(cases)} not run" in done.stdout
    assert state["partial"] == [f"{len(cases)} of {len(cases)} cases not run", "fuzz skipped (time budget of 0 s spent by the cases)",
                                "perf skipped (time budget of 0 s spent)"]
    assert state["finished"] and state["complete"] is False, "it ran to its end, but left things out: not complete"
    # Nothing in common with the previous results: no diff, said so; never a regression.
    assert state["diff"]["previous"] is None and "no case in common" in state["diff"]["note"]
    assert not (out / "diff.json").exists()


def _record_count(path: Path) -> int:
    return len(read_records(path)[0]) if path.exists() else 0


def test_a_killed_nightly_keeps_its_cases_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "killed"
    args = ("--out", str(out), "--matrix", "smoke", "--engines", "torch-fsdp,builtin", "--references", "ddp,local",
            "--limit", "8", "--fuzz-profile", "none", "--no-progress", "--no-perf")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "nightly", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while _record_count(out / "results.jsonl") < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the nightly ended before it could be killed"
        proc.send_signal(signal.SIGKILL)  # no clean-up of any kind; its ranks die with it
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    kept = _record_count(out / "results.jsonl")
    assert 1 <= kept < 8

    # Refused before any rank starts: in this process (the command's own entry point), not a fresh interpreter.
    assert main(["nightly", *args]) == 2
    assert "--resume" in capsys.readouterr().err

    stored = json.loads((out / "results.jsonl.selection.json").read_text())
    # The resume line the nightly prints names --out and --resume only: the rest is the stored selection
    # and the earlier attempt's options (no fuzz, no perf), not the defaults (the 10,920-case full matrix).
    resumed = _nightly("--out", str(out), "--resume", "--no-progress")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records, _ = read_records(out / "results.jsonl")
    ids = [f"{r.case['engine']}:{r.case['reference']}:{r.case_id}" for r in records]
    assert len(ids) == len(set(ids)) == 8 and sorted(ids) == sorted(stored["case_ids"])
    state = json.loads((out / "nightly.json").read_text())
    assert state["resumed"] and state["cases"]["already_recorded"] == kept and state["cases"]["selected"] == 8
    assert state["cases"]["recorded"] == 8 - kept and state["complete"]
    assert state["selection"]["id"] == stored["id"] and state["fuzz"]["skipped"] and state["perf"]["skipped"]


@pytest.mark.gpu
@needs_gpus(1)
# The nightly's subprocess may take its 600 s where the GPUs are busy with a whole tree under xdist (the 1B
# perf section's steps share every GPU with the other workers' ranks); pytest-timeout's limit is that one.
@pytest.mark.timeout(660)
def test_nightly_on_the_gpus(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    done = _nightly("--out", str(out), "--matrix", "smoke", "--engines", "torch-fsdp,builtin", "--fuzz-profile", "none",
                    "--no-progress", gpus=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((out / "nightly.json").read_text())
    n = n_gpus()
    assert state["cases"]["not_run"] == 0 and state["cases"]["device"] == "cuda"
    pairs = [lane for lane in state["cases"]["lanes"] if lane["world_size"] == 2]
    assert len(pairs) >= 1 and state["cases"]["cases_per_s"] > 0
    # Several pools on each GPU (or ranks sharing one): CUDA MPS wanted, and on where its daemon is installed.
    assert state["cases"]["mps"]["wanted"], state["cases"]["mps"]
    if shutil.which(CONTROL):
        assert state["cases"]["mps"]["active"], state["cases"]["mps"]
    if n < 2:
        # One GPU: both ranks of every pool on it, through gloo; the perf section is the CPU smoke check
        # (gloo's host staging is no measure of NCCL overlap).
        assert state["cases"]["backend"] == "gloo" and state["cases"]["ranks_per_gpu"] == 2
        assert {tuple(lane["devices"]) for lane in pairs} == {(0, 0)}
        assert state["perf"]["kind"] == "smoke", state["perf"]
        return
    assert state["cases"]["backend"] == "nccl" and state["cases"]["ranks_per_gpu"] == 1
    groups = n // 2
    # Every GPU pair runs cases, several pools on each side by side.
    assert {tuple(lane["devices"]) for lane in pairs} == {(2 * i, 2 * i + 1) for i in range(groups)}
    assert len(pairs) % groups == 0
    assert state["perf"]["kind"] == "gpu", state["perf"]
    assert state["perf"]["rows"]["builtin/full_shard"]["ratio"] > 0 and state["perf"]["rows"]["builtin/full_shard"]["peak_gib"] > 0
