"""An engine that produces NaN or inf: the verdict says so (at which step), and its record is strict JSON
that reads back with the same values; records written before, with bare ``Infinity``, still read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness.cases.case import CaseConfig
from harness.cases.records import RunInfo
from harness.collect.collector import ResultWriter, read_records
from harness.compare.compare import Observation, compare_observations
from harness.compare.parity import RankResult, record_from_outcome
from harness.compare.tolerance import TolerancePolicy
from harness.engines.adapters import ParamSlice
from harness.ranks.pool import PoolOutcome

CASE = CaseConfig(steps=3)
RUN = RunInfo(run_id="r1", host="h", torch_version="2.13.0", backend="gloo")


def _side(losses: list[float]) -> Observation:
    """One side's observation: its gradient (and parameter) turns non-finite with its loss."""
    weights = [0.5 if math.isfinite(loss) else loss for loss in losses]
    grads = [[ParamSlice("w", 0, torch.full((3,), w))] for w in weights]
    return Observation(losses=list(losses), grad_norms=[0.5] * len(losses), grads=grads,
                       params=[ParamSlice("w", 0, torch.full((3,), weights[-1]))])


def _record(engine_losses: list[list[float]]) -> tuple[list[float], object]:
    """The record of a case whose engine showed ``engine_losses`` per rank (the reference: 1.0 a step),
    decided by the harness's own comparison and verdict."""
    values = []
    for losses in engine_losses:
        engine, reference = _side(losses), _side([1.0] * len(losses))
        findings = compare_observations(engine, reference, TolerancePolicy(1.3e-6, 1e-5))
        values.append(RankResult("ok", findings=findings, curves={
            "loss": {"engine": engine.losses, "reference": reference.losses},
            "grad_norm": {"engine": engine.grad_norms, "reference": reference.grad_norms},
        }))
    return values, record_from_outcome(CASE, PoolOutcome("ok", values))


@pytest.mark.parametrize("bad, word", [(math.nan, "NaN"), (math.inf, "inf")])
def test_a_non_finite_loss_is_the_reason_with_its_step(bad: float, word: str) -> None:
    _, record = _record([[1.0, 1.0, 1.0], [1.0, bad, bad]])
    assert record.verdict == "fail"
    assert record.reason.startswith(f"the engine produced {word} at step 1 (loss on rank 1)"), record.reason
    assert "missing or uncovered" not in record.reason


def test_a_finite_disagreement_keeps_the_worst_quantity_as_the_reason() -> None:
    _, record = _record([[1.0, 1.0, 1.0], [1.0, 1.5, 1.0]])
    assert record.verdict == "fail" and record.reason.startswith("loss@1: max_abs 0.5"), record.reason


def test_a_record_of_non_finite_values_is_strict_json_and_reads_back(tmp_path: Path) -> None:
    _, record = _record([[1.0, 1.0, 1.0], [1.0, math.nan, math.inf]])
    out = tmp_path / "r.jsonl"
    with ResultWriter(out, RUN) as writer:
        writer.append(record)

    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in a record: not strict JSON")

    line = out.read_text(encoding="utf-8")
    json.loads(line, parse_constant=refuse)
    (back,), bad = read_records(out)
    assert not bad
    assert math.isnan(back.curves["loss"]["engine"][1][1]) and back.curves["loss"]["engine"][1][2] == math.inf
    assert [(e.name, e.max_abs, e.ratio) for e in back.errors if math.isinf(e.ratio)] == \
        [(e.name, e.max_abs, e.ratio) for e in record.errors if math.isinf(e.ratio)] != []
    assert back.reason == record.reason


def test_a_record_written_with_bare_infinity_still_reads(tmp_path: Path) -> None:
    _, record = _record([[1.0, 1.0, 1.0], [1.0, math.inf, math.inf]])
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(record.to_dict()) + "\n", encoding="utf-8")  # how records were written before
    assert "Infinity" in old.read_text(encoding="utf-8")
    (back,), bad = read_records(old)
    assert not bad and back.curves["loss"]["engine"][1][1] == math.inf
    assert max(e.ratio for e in back.errors) == math.inf
