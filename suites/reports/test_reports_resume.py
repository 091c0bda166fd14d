"""The checkpoint side of a report: the column group, the cross-engine resume matrix, diffs and CSV
round trips of the optimizer and checkpoint axes (synthetic records, no processes)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from conftest import write_results
from synthetic_records import record

import reports
from harness.cases.case import CaseConfig
from reports.diff import cell_name, diff_frames
from reports.matrix import latest, records_frame
from reports.resume_matrix import checkpoint_table, resume_matrices

FSDP2 = {"use_orig_params": True, "backward_prefetch": "pre"}
LOCAL_REASON = "a LOCAL state dict is the saving engine's own flat shards at its own world size"


def _records() -> list:
    return [
        record(CaseConfig(engine="builtin")),
        record(CaseConfig(engine="builtin", checkpoint="full")),
        record(CaseConfig(engine="builtin", checkpoint="sharded", optimizer="adamw")),
        record(CaseConfig(engine="builtin", checkpoint="full", resume_engine="torch-fsdp")),
        record(CaseConfig(engine="torch-fsdp", checkpoint="full", resume_engine="builtin"), verdict="fail", ratio=40.0),
        record(CaseConfig(engine="builtin", checkpoint="sharded", resume_engine="torch-fsdp2", **FSDP2)),
        record(CaseConfig(engine="builtin", checkpoint="local", resume_engine="torch-fsdp"), verdict="unsupported",
               ratio=None, reason=LOCAL_REASON),
    ]


def _frame() -> pd.DataFrame:
    return latest(records_frame(_records()))[0]


def test_checkpoint_column_group() -> None:
    table = checkpoint_table(_frame())
    assert table is not None
    assert table.loc["builtin", ("full", "sgd")] == "2/2"
    assert table.loc["builtin", ("sharded", "adamw")] == "1/1"
    assert table.loc["torch-fsdp", ("full", "sgd")] == "0/1"
    assert table.loc["builtin", ("none", "sgd")] == "1/1"
    assert checkpoint_table(latest(records_frame(_records()[:1]))[0]) is None


def test_resume_matrix_is_saved_by_times_loaded_by() -> None:
    matrices = resume_matrices(_frame())
    assert set(matrices) == {"full", "sharded", "local"}
    full = matrices["full"]
    assert full.loc["builtin", "builtin"] == "1/1"  # the engine resuming its own checkpoint
    assert full.loc["builtin", "torch-fsdp"] == "1/1"
    assert full.loc["torch-fsdp", "builtin"] == "0/1"
    assert matrices["sharded"].loc["builtin", "torch-fsdp2"] == "1/1"
    assert matrices["local"].loc["builtin", "torch-fsdp"].startswith("unsupported: a LOCAL state dict")


def test_report_shows_both_and_survives_its_csv(tmp_path: Path) -> None:
    results = write_results(tmp_path / "results.jsonl", _records())
    out = tmp_path / "report"
    reports.build(results, out)
    text = (out / "matrix.md").read_text()
    assert "## Checkpoints: save half-way, resume, compare" in text
    assert "### Resume matrix · full: saved by (rows) x loaded by (columns)" in text
    assert "unsupported: a LOCAL state dict" in text
    assert "Resume matrix · sharded" in (out / "matrix.html").read_text()
    again = reports.load(out).frame
    assert list(again["resume_engine"]) == list(_frame()["resume_engine"])
    assert set(again["checkpoint"]) == {"none", "full", "sharded", "local"}
    assert resume_matrices(again)["full"].equals(resume_matrices(_frame())["full"])


def test_results_from_before_the_axes_read_as_defaults(tmp_path: Path) -> None:
    frame = _frame().drop(columns=["optimizer", "checkpoint", "resume_engine"])
    path = tmp_path / "old"
    path.mkdir()
    frame.iloc[:1].to_csv(path / "results.csv", index=False)
    old = reports.load(path).frame
    assert (old["optimizer"].iloc[0], old["checkpoint"].iloc[0], old["resume_engine"].iloc[0]) == ("sgd", "none", "")


def test_diff_names_the_checkpoint_cell() -> None:
    old = _frame()
    new = old.copy()
    row = new["full_id"].str.contains("resume_torch-fsdp$") & new["full_id"].str.startswith("builtin:")
    new.loc[row, "verdict"] = "fail"
    result = diff_frames(old, new)
    (change,) = result.regressions
    assert change.cell.endswith("· ckpt full → torch-fsdp")
    assert cell_name(old.iloc[0]).endswith("bwd none")
    assert cell_name(old[old["optimizer"] == "adamw"].iloc[0]).endswith("· adamw · ckpt sharded")
