"""A checkpoint one rank cannot read: the load error is recorded on every rank (the ranks agree whether the
load succeeded before any goes on), nothing hangs, and no checkpoint directory is left behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from harness.cases.case import CaseConfig
from harness.compare.parity import record_from_outcome, run_case_on_rank
from harness.ranks.pool import RankPool


def _checkpoint_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("fsdp-parity-ckpt-*"))


@pytest.mark.parametrize("kind", ["local", "full"])
def test_a_corrupted_checkpoint_is_an_error_on_every_rank_and_leaves_no_directory(parity_pool: RankPool, kind: str) -> None:
    case = CaseConfig(engine="builtin", reference="local", model="nested", checkpoint=kind, steps=2,
                      extras=(("fault", "corrupt_checkpoint_rank1"),))
    before = _checkpoint_dirs()
    record = record_from_outcome(case, parity_pool.run(run_case_on_rank, case, timeout_s=60.0))
    assert record.verdict == "error", f"{record.verdict}: {record.reason}"
    assert "could not be loaded" in record.reason and "rank 1:" in record.reason, record.reason
    tracebacks = record.detail["tracebacks"]
    assert set(tracebacks) == {"0", "1"} and all("CheckpointLoadError" in t for t in tracebacks.values())
    assert _checkpoint_dirs() - before == set(), "the checkpoint directory was left behind"
