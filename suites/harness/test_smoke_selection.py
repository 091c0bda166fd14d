"""README's quick start, ``harness run --matrix smoke``: every case it selects is judged, on CPU ranks and on
GPUs (each engine's cases can run there and their reference can judge them: mixed precision against
``local``), it still shows every strategy, precision and prefetch value each engine has, an engine that
drops mixed precision fails it, and the run's table says why the cases of other selections are unsupported."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.compare.parity import record_from_outcome, run_case_on_rank, smoke_refusal
from harness.ranks.pool import RankPool
from harness.run.runner import Progress, Selection, generate_cases, select_cases, summary

MIXED = ("bf16", "fp16", "reduce_only")
#: per engine, what the smoke selection shows of each axis (FSDP2: no NO_SHARD, only BACKWARD_PRE).
SHOWN = {
    "builtin": ({"full_shard", "shard_grad_op", "no_shard"}, {"fp32", *MIXED}, {"none", "pre", "post"}),
    "torch-fsdp": ({"full_shard", "shard_grad_op", "no_shard"}, {"fp32", *MIXED}, {"none", "pre", "post"}),
    "torch-fsdp2": ({"full_shard", "shard_grad_op"}, {"fp32", *MIXED}, {"pre"}),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_smoke_case_is_judged_and_every_value_is_still_shown(device: str) -> None:
    cases = generate_cases("smoke", [2], judged_on=device)
    refuse = smoke_refusal(device)
    assert {c.full_id: refuse(c) for c in cases if refuse(c)} == {}, "smoke cases the ranks would call unsupported"
    for engine, (strategies, precisions, prefetches) in SHOWN.items():
        mine = [c for c in cases if c.engine == engine]
        assert {c.sharding_strategy for c in mine} == strategies, engine
        assert {c.precision for c in mine} == precisions, engine
        assert {c.backward_prefetch for c in mine} == prefetches, engine
        assert {c.reference for c in mine if c.precision in MIXED} == {"local"}, "mixed precision is judged by local"
        assert {c.reference for c in mine if c.precision == "fp32"} == {"ddp"}, "the reference axis keeps DDP"
    assert len(cases) == 12, "the quick start stays small"


def test_the_generators_without_refusals_are_unchanged() -> None:
    # Only the smoke selection asks the ranks' refusals; pairwise and full (and their case ids) do not.
    assert generate_cases("pairwise", [2], judged_on="cpu") == generate_cases("pairwise", [2])
    assert select_cases(Selection(matrix="pairwise"), [2]) == generate_cases("pairwise", [2])


def test_an_engine_dropping_mixed_precision_fails_the_smoke_run(parity_pool: RankPool) -> None:
    # The smoke run's mixed-precision cases of torch FSDP1, on an adapter that drops the MixedPrecision policy.
    cases = [c for c in select_cases(Selection(matrix="smoke", engines=["torch-fsdp"]), [2]) if c.precision in MIXED]
    assert cases
    for case in cases:
        planted = case.replace(extras=(("fault", "ignore_option:mixed_precision"),))
        record = record_from_outcome(planted, parity_pool.run(run_case_on_rank, planted))
        assert record.verdict == "fail", f"{planted.full_id}: {record.verdict} {record.reason}"


def test_the_run_table_says_why_cases_are_unsupported(tmp_path: Path) -> None:
    progress = Progress(4, enabled=False)
    why = ["mixed precision (bf16) against ddp: see this case against local", "torch-fsdp: CPU offload needs a GPU"]
    for verdict, reason in (("unsupported", why[0]), ("unsupported", why[0]), ("unsupported", why[1]), ("pass", "")):
        progress.update(CaseRecord(case=CaseConfig().to_dict(), case_id="x", verdict=verdict, reason=reason), "x")
    progress.close()
    text = summary(progress.counts, tmp_path / "r.jsonl", 1.0, progress.unsupported)
    lines = text.splitlines()
    first, second = (next(i for i, line in enumerate(lines) if reason in line) for reason in why)
    assert lines[first].split()[0] == "2" and lines[second].split()[0] == "1" and first < second, text
    assert collections.Counter(progress.unsupported) == {why[0]: 2, why[1]: 1}
