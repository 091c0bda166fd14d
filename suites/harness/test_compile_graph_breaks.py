"""A compiled case breaks the graph no more often on our engine than on torch FSDP1: both keep their
hooks out of Dynamo (ours by ``engine.dynamo``), so Dynamo compiles the wrapped modules between the
units' eager forwards. Counted by ``harness.compare.compiling`` on two CPU ranks (``aot_eager``), on the models
the training-loop slice compiles. On CUDA ranks the compiled case runs inductor; the count there is not
yet measured (on one H100 with gloo ranks sharing it this comparison failed, cause not yet read)."""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.compare.compiling import CompileCounts
from harness.compare.parity import record_from_outcome, run_case_on_rank
from harness.pytest_plugin.pools import rank_pool_fixture
from harness.ranks.pool import RankPool


cpu_pool = rank_pool_fixture(2, "cpu", timeout_s=300.0)


def _counts(pool: RankPool, case: CaseConfig) -> CompileCounts:
    record = record_from_outcome(case, pool.run(run_case_on_rank, case))
    assert record.verdict == "pass", (case.engine, record.verdict, record.reason)
    counts = CompileCounts.from_notes(record.detail.get("notes", []))
    assert counts is not None and counts.graphs > 0, (case.engine, record.detail.get("notes"))
    return counts


@pytest.mark.parametrize("model", ["nested", "transformer"])
def test_ours_breaks_the_graph_no_more_than_torch_fsdp1(cpu_pool: RankPool, model: str) -> None:
    case = CaseConfig(engine="builtin", reference="local", model=model, steps=2, use_orig_params=True, compile="compiled")
    ours = _counts(cpu_pool, case)
    torch_fsdp1 = _counts(cpu_pool, case.replace(engine="torch-fsdp"))
    assert ours.graph_breaks <= torch_fsdp1.graph_breaks, (ours, torch_fsdp1)
