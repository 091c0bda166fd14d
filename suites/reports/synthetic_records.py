"""Synthetic records for the report tests: deterministic, covering every verdict and cell status."""

from __future__ import annotations

import random

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, QuantityError, RunInfo
from harness.selection.matrix import generate

RUN = RunInfo(run_id="20260101-000000-abcdef", host="ci", torch_version="2.13.0", backend="gloo", git_rev="0" * 40)


def record(case: CaseConfig, verdict: str = "pass", ratio: float | None = 0.2, reason: str = "", time: float = 1.0,
           expected_failure: str | None = None) -> CaseRecord:
    errors = []
    if ratio is not None:
        errors = [
            QuantityError("loss", ratio * 1e-5, ratio * 1e-6, 1e-5, 1.3e-6, ratio <= 1, ratio),
            QuantityError("grad:0.weight", ratio * 5e-6, 0.0, 1e-5, 1.3e-6, True, ratio / 2),
        ]
    if verdict != "pass" and not reason:
        reason = f"{verdict}: synthetic"
    return CaseRecord(case=case.to_dict(), case_id=case.case_id, verdict=verdict, reason=reason,
                      run=RUN, time=time, errors=errors, wall_s=0.5, expected_failure=expected_failure)


def mixed_records(seed: int = 0) -> list[CaseRecord]:
    """The pairwise matrix with a few of every non-pass verdict, plus an all-unsupported cell."""
    rng = random.Random(seed)
    out = []
    for case in generate("pairwise", model="nested", reference="ddp"):
        roll = rng.random()
        if case.engine == "torch-fsdp2" and case.sharding_strategy == "no_shard":
            out.append(record(case, "unsupported", None, "FSDP2 has no NO_SHARD"))
        elif roll < 0.08:
            out.append(record(case, "fail", 10 ** rng.uniform(0.2, 3)))
        elif roll < 0.11:
            out.append(record(case, "timeout", None, "rank 1 hung in all_gather"))
        elif roll < 0.13:
            out.append(record(case, "crash", None, "rank 0 exited with SIGSEGV"))
        elif roll < 0.15:
            out.append(record(case, "error", None, "RuntimeError: boom"))
        else:
            out.append(record(case, "pass", 10 ** rng.uniform(-4, 0)))
    return out
