"""The planted training-loop engines (``loop_engines``) fail exactly the cases of their axis: a case of
the axis fails (on values, on the ``grad_accum`` knob check, or by crashing under compile), and a case
of the other training-loop axes passes. On the harness suites' parity pool (gloo ranks on CPU)."""

from __future__ import annotations

import re

import pytest
from loop_engines import CLIP_LOCAL, DECAY_DROPPED, DYNAMO_TRACED, SYNC_ALWAYS, run_case_with_loop_engines

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.compare.parity import record_from_outcome
from harness.ranks.pool import RankPool

#: short cases on the nested units, compared with the local reference.
BASE = CaseConfig(engine="builtin", reference="local", model="nested", steps=3, use_orig_params=True)


def _run(pool: RankPool, case: CaseConfig) -> CaseRecord:
    return record_from_outcome(case, pool.run(run_case_with_loop_engines, case))


@pytest.mark.parametrize(
    ("engine", "axis", "other"),
    [
        (CLIP_LOCAL, {"clip_grad": "norm"}, {"grad_accum": "no_sync", "activation_checkpointing": "non_reentrant"}),
        (SYNC_ALWAYS, {"grad_accum": "no_sync"}, {"grad_accum": "sync", "clip_grad": "norm"}),
        (DYNAMO_TRACED, {"compile": "compiled"}, {"clip_grad": "norm", "grad_accum": "no_sync"}),
        (DECAY_DROPPED, {"optimizer": "adamw_groups"}, {"optimizer": "two_optimizers", "clip_grad": "norm"}),
    ],
    ids=[CLIP_LOCAL, SYNC_ALWAYS, DYNAMO_TRACED, DECAY_DROPPED],
)
def test_a_planted_engine_fails_its_axis_only(parity_pool: RankPool, engine: str, axis: dict, other: dict) -> None:
    failing = _run(parity_pool, BASE.replace(engine=engine, **axis))
    assert failing.verdict in ("fail", "crash", "error"), (failing.verdict, failing.reason)
    if engine == SYNC_ALWAYS:
        # The numbers agree: only the trace shows the reductions no_sync should have skipped.
        assert failing.verdict == "fail" and failing.reason.startswith("knob grad_accum ignored"), failing.reason
    if engine == CLIP_LOCAL:
        assert "clip_norm@" in failing.reason or "grad:" in failing.reason, failing.reason
    if engine == DECAY_DROPPED:
        # A wrong decay shows only once a step has decayed the weights: the first step's values agree.
        first = re.search(r"at step (\d+)", failing.reason)
        assert failing.verdict == "fail" and first is not None and int(first.group(1)) >= 2, failing.reason
    passing = _run(parity_pool, BASE.replace(engine=engine, **other))
    assert passing.verdict == "pass", (passing.verdict, passing.reason)
