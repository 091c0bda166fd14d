"""The ranks' reference cache (``harness.compare.reference_cache``): what keys it, and that a case whose reference
and budgets come from it gets bitwise the record it gets when they are computed again."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.cases.case import CaseConfig
from harness.compare import parity
from harness.compare.parity import record_from_outcome, run_case_on_rank
from harness.compare.phases import TIMING_DETAIL
from harness.compare.reference_cache import CachedReference, ReferenceCache, cacheable, reference_key
from harness.ranks.pool import RankPool
from harness.ranks.rank import RankContext

CPU = torch.device("cpu")
BASE = CaseConfig(engine="builtin", reference="local", model="nested", steps=2)


def _key(case: CaseConfig) -> tuple[Any, ...]:
    return reference_key(case, case.precision_spec, "none", CPU)


def test_the_key_ignores_how_the_engine_shards_and_nothing_else() -> None:
    same = [BASE.replace(engine="torch-fsdp"), BASE.replace(sharding_strategy="no_shard"), BASE.replace(cpu_offload=True),
            BASE.replace(use_orig_params=True, backward_prefetch="pre", forward_prefetch=True, init_mode="never"),
            BASE.replace(compile="compiled", check_determinism=True)]
    assert {_key(c) for c in same} == {_key(BASE)}
    other = [BASE.replace(reference="ddp"), BASE.replace(model="transformer"), BASE.replace(precision="bf16"),
             BASE.replace(steps=3), BASE.replace(seed=1), BASE.replace(optimizer="adamw"), BASE.replace(world_size=4),
             BASE.replace(clip_grad="norm"), BASE.replace(grad_accum="no_sync"),
             BASE.replace(grad_accum="no_sync", extras=(("micro_batches", 3),))]
    assert len({_key(c) for c in other} | {_key(BASE)}) == len(other) + 1
    assert reference_key(BASE, BASE.precision_spec, "ablation", CPU) != _key(BASE), "budgets derived otherwise"
    # Past 2 ranks a hybrid strategy's gradients are summed within its shard groups first, as its reference does.
    wide = BASE.replace(world_size=4)
    hybrid = [wide.replace(sharding_strategy="hybrid_shard"), wide.replace(sharding_strategy="hybrid_shard_zero2")]
    assert {_key(c) for c in hybrid} == {_key(hybrid[0])} != {_key(wide)}
    assert _key(hybrid[0].replace(extras=(("shard_size", 1),))) != _key(hybrid[0])
    assert not cacheable(BASE.replace(stress="delay")) and not cacheable(BASE.replace(extras=(("fault", "perturb_grad_rank1"),)))


def test_the_least_recently_used_entry_goes_first() -> None:
    cache, entry = ReferenceCache(max_entries=2), CachedReference(parity.Observation(), {}, {}, ())
    cache.put(("a",), entry)
    cache.put(("b",), entry)
    assert cache.get(("a",)) is entry
    cache.put(("c",), entry)
    assert cache.get(("b",)) is None and cache.get(("a",)) is entry and len(cache) == 2


def clear_references(ctx: RankContext, payload: Any) -> int:
    parity.REFERENCES.clear()
    return parity.REFERENCES.hits


def reference_hits(ctx: RankContext, payload: Any) -> int:
    return parity.REFERENCES.hits


def _quantities(pool: RankPool, case: CaseConfig) -> dict[str, Any]:
    record = record_from_outcome(case, pool.run(run_case_on_rank, case))
    assert record.errors, f"{case.full_id}: {record.verdict} {record.reason}: nothing compared"
    return {"verdict": record.verdict, "errors": [(e.name, e.max_abs, e.max_rel, e.atol, e.ratio) for e in record.errors],
            "detail": {k: v for k, v in record.detail.items() if k not in TIMING_DETAIL}}


@pytest.mark.parametrize("first", [BASE.replace(reference="ddp"), BASE.replace(precision="bf16")], ids=lambda c: c.case_id)
def test_a_cached_reference_gives_bitwise_the_record_of_a_computed_one(parity_pool: RankPool, first: CaseConfig) -> None:
    # Another engine and another sharding of the same training: the second case reuses the first's.
    second = first.replace(engine="torch-fsdp", sharding_strategy="shard_grad_op", use_orig_params=True)
    parity_pool.run(clear_references, None)
    _quantities(parity_pool, first)
    before = parity_pool.run(reference_hits, None).values
    cached = _quantities(parity_pool, second)
    assert [h - b for h, b in zip(parity_pool.run(reference_hits, None).values, before)] == [1, 1], "every rank hit"
    parity_pool.run(clear_references, None)
    assert _quantities(parity_pool, second) == cached


def test_a_prefetch_baseline_runs_once_per_configuration_and_matches_a_fresh_run(parity_pool: RankPool) -> None:
    """The prefetch knob checks' baseline (``harness.compare.prefetch_baseline``): the other reference's case
    reads the kept trace, which is the trace a fresh run gives; a faulted case runs its own."""
    import harness_jobs

    case = BASE.replace(engine="builtin", reference="ddp", backward_prefetch="none", world_size=2)
    outcome = parity_pool.run(harness_jobs.prefetch_baselines, case)
    assert outcome.status == "ok", outcome.reason
    for value in outcome.values:
        assert value["runs"] == ["ddp", "ddp"], value  # the local twin read it; the faulted one ran
        assert value["same"] and value["faulted_ran"], value


OWN_RUNS = [BASE.replace(reference="ddp", steps=5), BASE.replace(engine="torch-fsdp", sharding_strategy="no_shard", steps=3),
            BASE.replace(engine="torch-fsdp", use_orig_params=True, forward_prefetch=True, grad_accum="no_sync"),
            BASE.replace(engine="torch-fsdp2", backward_prefetch="pre", activation_checkpointing="non_reentrant"),
            BASE.replace(sharding_strategy="shard_grad_op", cpu_offload=True, steps=1)]


@pytest.mark.parametrize("case", OWN_RUNS, ids=lambda c: f"{c.engine}-{c.case_id}")
def test_a_case_s_own_run_is_the_trace_a_baseline_run_of_it_records(parity_pool: RankPool, case: CaseConfig) -> None:
    import harness_jobs

    outcome = parity_pool.run(harness_jobs.own_run_as_baseline, case)
    assert outcome.status == "ok", outcome.reason
    for value in outcome.values:
        assert value["kept"] and value["same"] and value["events"] > 0, value


@pytest.mark.parametrize("case", [BASE.replace(backward_prefetch="pre", forward_prefetch=True), BASE.replace(checkpoint="full"),
                                  BASE.replace(compile="compiled"), BASE.replace(extras=(("fault", "ignore_option:none"),))],
                         ids=["both_on", "checkpoint", "compiled", "faulted"])
def test_no_run_is_kept_that_no_check_asks_for_or_that_a_baseline_run_would_not_repeat(case: CaseConfig) -> None:
    from harness.compare.prefetch_baseline import BASELINES, keep_own_run

    ctx = RankContext(0, 2, 0, 2, "gloo", CPU)
    before = len(BASELINES)
    keep_own_run(case, ctx, [])
    assert len(BASELINES) == before


@pytest.mark.parametrize("prefetch", [{"backward_prefetch": "post"}, {"forward_prefetch": True}], ids=["backward", "forward"])
def test_a_baseline_kept_from_a_case_s_own_run_gives_bitwise_the_record_of_a_baseline_run(
        parity_pool: RankPool, prefetch: dict[str, Any]) -> None:
    import harness_jobs

    plain = BASE.replace(engine="torch-fsdp", reference="ddp", steps=3)
    case = plain.replace(reference="local", **prefetch)
    before = parity_pool.run(harness_jobs.clear_baselines, None).values
    _quantities(parity_pool, plain)
    kept = _quantities(parity_pool, case)
    assert [h - b for h, b in zip(parity_pool.run(harness_jobs.baseline_hits, None).values, before)] == [1, 1], "plain's run"
    before = parity_pool.run(harness_jobs.clear_baselines, None).values
    assert _quantities(parity_pool, case) == kept
    assert parity_pool.run(harness_jobs.baseline_hits, None).values == before, "ran its own baseline"
    assert [k["status"] for k in kept["detail"]["knobs"] if k["knob"] in prefetch] == ["ok"], kept["detail"]["knobs"]
