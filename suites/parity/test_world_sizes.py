"""Parity at 4 and 8 ranks on CPU (gloo): what only shows past two ranks, on any machine (no GPU
needed).

- Hybrid sharding with real shard and replicate groups: 2x2 at world size 4; 2x4 (the harness's
  default shard-group size, half the world) and 4x2 (``extras=(("shard_size", 2),)``) at world size 8;
  HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on every engine. The sharding knob check requires the
  gradients to be all-reduced across the replicas (a group of world_size / shard_size ranks).
- Uneven shards at world size 8: a 5-element unit (``world_sizes.UnevenModel``) leaves ranks 5-7
  holding only padding under FULL_SHARD (and rank 3 of each shard group under 2x4 hybrid). Each
  such case first passes against its reference, then every rank reports what it holds of that
  unit right after wrapping, which must equal what ``engine.layout`` (FSDP1 engines) or
  ``torch.chunk`` (FSDP2) predicts, with some rank holding nothing but padding.
- Mixed precision at world size 8: bf16 on the tied transformer for 5 steps, where the loss budget
  derived on one rank alone was too tight for torch FSDP1 itself (``harness.compare.compare.worst_budgets``).
- Mixed precision at world size 4: bf16 on the tied transformer with two optimizers, clipping and two
  micro-batches under ``no_sync``, whose budget measured on the emulation in rank order alone was too tight
  for torch FSDP1 and the built-in engine (``harness.compare.tolerance.emulation_orders``).
- Many units in flight at world size 8: every submodule a unit, with forward prefetch and
  BACKWARD_PRE (the prefetch knob checks rerun a baseline, so the reordering is checked too).
- Full precision at world size 8: the tied transformer for 5 steps against DDP, which failed torch's
  fixed fp32 defaults on both FSDP1 engines (reduction order; ``harness.compare.tolerance.budget_source``), and
  the same case with a gradient error of 1e-5 (relative) planted in the built-in engine's reduction,
  which must still fail under the widened tolerance ([Note: planted reduction bugs] in ``world_sizes``).

Every case runs through the harness's own path (``run_case_on_rank`` on a ``RankPool``, decided by
``record_from_outcome`` and ``outcome_of``); an unsupported case skips with the engine's reason.

Not covered here: ``limit_all_gathers``. Neither the case matrix nor the adapters have it as an axis
(both FSDP1 engines run with their default, True), and on CPU both engines' rate limiters are no-ops
(the built-in engine enables its limiter on CUDA only; torch's waits on ``torch.cpu`` events, which
are complete as soon as recorded), so it needs real GPUs.
"""

from __future__ import annotations

import pytest
import torch

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.collect.expectations import ExpectedFailure
from harness.compare.compare import worst_budgets
from harness.compare.tolerance import DEFAULT_TOLERANCES
from harness.pytest_plugin import expect_failure
from harness.pytest_plugin.cases import outcome_of
from harness.pytest_plugin.pools import rank_pool_fixture
from harness.ranks.pool import RankPool
from suites.parity.world_sizes import (
    GAIN_NUMEL,
    UNEVEN,
    Holding,
    expected_dim0_holdings,
    expected_flat_holdings,
    gain_holding_job,
    run_case,
    run_planted_case,
    shard_group_size,
)

# Both pools are module-scoped: under pytest-xdist the module must stay on one worker. Every case is a
# parameter, so --engine and --reference deselect the others (engine_cases) and no pool starts for them.
pytestmark = [pytest.mark.xdist_group("parity-world-sizes"), pytest.mark.engine_cases]

STEPS = 3
FSDP1 = ("builtin", "torch-fsdp")
ENGINES = ("builtin", "torch-fsdp", "torch-fsdp2")


def _case(engine: str, **fields: object) -> CaseConfig:
    """A case on ``engine``; FSDP2 always uses the original parameters and BACKWARD_PRE."""
    if engine == "torch-fsdp2":
        fields = {**fields, "use_orig_params": True, "backward_prefetch": "pre"}
    return CaseConfig(engine=engine, **{"steps": STEPS, **fields})  # type: ignore[arg-type]


# gloo on CPU even on a GPU host: these cases stand in for GPUs that are not there.
pool2, pool4, pool8 = (rank_pool_fixture(n, "cpu", timeout_s=180.0) for n in (2, 4, 8))


def _passes(pool: RankPool, case: CaseConfig) -> CaseRecord:
    """Run the case; pass returns its record, unsupported skips with the reason, anything else fails."""
    record = run_case(pool, case)
    outcome = outcome_of(record)
    if outcome.action == "skip":
        pytest.skip(reason=outcome.message)
    if outcome.action == "fail":
        pytest.fail(f"{case.full_id}: {outcome.message}", pytrace=False)
    knobs = {k["knob"]: k["status"] for k in record.detail["knobs"]}
    assert knobs["sharding_strategy"] == "ok", record.detail["knobs"]
    assert any(e.name.startswith("grad:") for e in record.errors), "no gradient was compared"
    return record


# ---------------------------------------------------------------------------------------------------
# Hybrid sharding: 2x2 at 4 ranks, 2x4 and 4x2 at 8


WS4_HYBRID = [
    _case("builtin", sharding_strategy="hybrid_shard", model="nested", reference="ddp", backward_prefetch="pre", world_size=4),
    _case("builtin", sharding_strategy="hybrid_shard_zero2", model="transformer", reference="local", use_orig_params=True, world_size=4),
    _case("builtin", sharding_strategy="hybrid_shard", model="nested", reference="local", precision="bf16", world_size=4),
    _case("torch-fsdp", sharding_strategy="hybrid_shard", model="transformer", reference="local", use_orig_params=True,
          backward_prefetch="post", world_size=4),
    _case("torch-fsdp", sharding_strategy="hybrid_shard_zero2", model="nested", reference="ddp", world_size=4),
    _case("torch-fsdp", sharding_strategy="hybrid_shard", model="nested", reference="local", precision="bf16", world_size=4),
    _case("torch-fsdp2", sharding_strategy="hybrid_shard", model="nested", reference="ddp", world_size=4),
    _case("torch-fsdp2", sharding_strategy="hybrid_shard_zero2", model="transformer", reference="local", world_size=4),
]


@pytest.mark.parametrize("case", WS4_HYBRID, ids=lambda c: c.full_id)
def test_hybrid_2x2_at_world_size_4(pool4: RankPool, case: CaseConfig) -> None:
    record = _passes(pool4, case)
    assert record.detail["collectives"]["all_reduce"] > 0, "hybrid gradients must be all-reduced across the 2 replicas"


WS8_HYBRID = [
    _case(engine, sharding_strategy=strategy, model=model, reference=reference, world_size=8,
          extras=(("shard_size", shard),) if shard != 4 else ())
    for engine in ENGINES
    for strategy, shard, model, reference in (
        ("hybrid_shard", 4, "nested", "ddp"),
        ("hybrid_shard", 2, "transformer", "local"),
        ("hybrid_shard_zero2", 4, "transformer", "local"),
        ("hybrid_shard_zero2", 2, "nested", "ddp"),
    )
]


@pytest.mark.parametrize("case", WS8_HYBRID, ids=lambda c: c.full_id)
def test_hybrid_2x4_and_4x2_at_world_size_8(pool8: RankPool, case: CaseConfig) -> None:
    record = _passes(pool8, case)
    assert record.detail["collectives"]["all_reduce"] > 0


# ---------------------------------------------------------------------------------------------------
# Hybrid with one rank per shard group (one GPU per node): all the averaging is across replicas

#: torch FSDP1 switches every strategy to NO_SHARD when its shard group has one rank, and its NO_SHARD
#: all-reduces over that one-rank group only: the replicas never average their gradients and drift
#: apart from the first step (seen with torch 2.11 and 2.13).
TORCH_FSDP1_ONE_RANK_SHARD_GROUP = ExpectedFailure(
    "torch FSDP1 runs hybrid sharding with a one-rank shard group as NO_SHARD over that group, "
    "so replicas never average gradients",
    engine="torch-fsdp",
)

WS2_HYBRID_ONE_RANK_SHARDS = [
    pytest.param(_case(engine, sharding_strategy=strategy, model="nested", reference="ddp", world_size=2,
                       extras=(("shard_size", 1),)),
                 marks=[expect_failure(TORCH_FSDP1_ONE_RANK_SHARD_GROUP)] if TORCH_FSDP1_ONE_RANK_SHARD_GROUP.covers(
                     "cpu", engine=engine) else [])
    for engine in ENGINES
    for strategy in ("hybrid_shard", "hybrid_shard_zero2")
]


@pytest.mark.parametrize("case", WS2_HYBRID_ONE_RANK_SHARDS, ids=lambda c: c.full_id)
def test_hybrid_with_one_rank_shard_groups_averages_across_replicas(pool2: RankPool, case: CaseConfig) -> None:
    record = _passes(pool2, case)
    assert record.detail["collectives"]["all_reduce"] > 0, "the 2 replicas must all-reduce their gradients"


# ---------------------------------------------------------------------------------------------------
# Uneven shards: ranks that hold only padding


UNEVEN_CASES = [
    _case("builtin", model=UNEVEN, reference="ddp", world_size=8),
    _case("builtin", model=UNEVEN, reference="local", use_orig_params=True, backward_prefetch="pre", world_size=8),
    _case("torch-fsdp", model=UNEVEN, reference="ddp", world_size=8),
    _case("torch-fsdp", model=UNEVEN, reference="local", use_orig_params=True, world_size=8),
    _case("torch-fsdp2", model=UNEVEN, reference="ddp", world_size=8),
    # 2x4: the last rank of each shard group holds only padding, and still joins the replicas' all-reduce.
    _case("builtin", model=UNEVEN, reference="local", sharding_strategy="hybrid_shard", world_size=8),
    _case("torch-fsdp", model=UNEVEN, reference="ddp", sharding_strategy="hybrid_shard_zero2", use_orig_params=True,
          world_size=8),
    _case("torch-fsdp2", model=UNEVEN, reference="local", sharding_strategy="hybrid_shard", world_size=8),
]


def _expected_holdings(case: CaseConfig) -> list[dict[str, int]]:
    """Per global rank: elements of the gain it should hold, from the layout (not from the engine)."""
    group = shard_group_size(case)
    if case.engine == "torch-fsdp2":
        per_rank = [{"weight": n} for n in expected_dim0_holdings((GAIN_NUMEL,), group)]
    else:
        per_rank = [{"weight": held[0]} for held in expected_flat_holdings([GAIN_NUMEL], group, case.use_orig_params)]
    return [per_rank[r % group] for r in range(case.world_size)]


@pytest.mark.parametrize("case", UNEVEN_CASES, ids=lambda c: c.full_id)
def test_uneven_shards_with_padding_only_ranks_at_world_size_8(pool8: RankPool, case: CaseConfig) -> None:
    _passes(pool8, case)
    expected = _expected_holdings(case)
    padding_only = [r for r, held in enumerate(expected) if not any(held.values())]
    assert padding_only, f"{case.full_id}: the layout predicts no padding-only rank; the case tests nothing"

    outcome = pool8.run(gain_holding_job, case)
    assert outcome.status == "ok", outcome.reason
    holdings: list[Holding] = outcome.values
    assert [h.held for h in holdings] == expected
    assert sum(h.held["weight"] for h in holdings) == GAIN_NUMEL * case.world_size // shard_group_size(case)
    if case.engine in FSDP1:
        # Those ranks really carry a shard, all of it padding, into every collective of the unit.
        assert all(holdings[r].shard_numel and holdings[r].shard_numel > 0 for r in padding_only)
        assert len({h.shard_numel for h in holdings}) == 1, "every rank's shard has the same padded size"


# ---------------------------------------------------------------------------------------------------
# Many units in flight


MANY_UNITS = [
    _case(engine, model="always_wrap", reference=reference, backward_prefetch="pre", forward_prefetch=True, world_size=8)
    for engine, reference in zip(ENGINES, ("ddp", "local", "ddp"))
]


@pytest.mark.parametrize("case", MANY_UNITS, ids=lambda c: c.full_id)
def test_many_units_prefetched_at_world_size_8(pool8: RankPool, case: CaseConfig) -> None:
    record = _passes(pool8, case)
    knobs = {k["knob"]: k["status"] for k in record.detail["knobs"]}
    assert knobs["forward_prefetch"] == "ok" and knobs["backward_prefetch"] == "ok", record.detail["knobs"]


# ---------------------------------------------------------------------------------------------------
# Mixed-precision budgets at 8 ranks


def test_budgets_are_the_worst_over_ranks() -> None:
    merged = worst_budgets([{"loss@4": 0.7, "grad:w": 0.1}, {"loss@4": 10.4, "grad:w": 0.1}, {"grad:local": 0.3}])
    assert merged == {"loss@4": 10.4, "grad:w": 0.1, "grad:local": 0.3}
    assert worst_budgets([]) == {}


# Before budgets were merged over ranks both FSDP1 engines failed this case identically: loss@4 off
# by 4.41 on rank 1 against a budget of 0.674, whose emulated loss had landed next to float64 by chance.
BF16_WS8 = [_case(engine, model="transformer", precision="bf16", reference="ddp", world_size=8, steps=5) for engine in FSDP1]


@pytest.mark.parametrize("case", BF16_WS8, ids=lambda c: c.full_id)
def test_bf16_transformer_at_world_size_8(pool8: RankPool, case: CaseConfig) -> None:
    record = _passes(pool8, case)
    assert record.detail["budget_source"] == "emulation"
    assert {k["knob"]: k["status"] for k in record.detail["knobs"]}["precision"] == "ok"


# Budgeted on the emulation in rank order alone both FSDP1 engines (bitwise equal) failed this case's
# generated twin (with compile and CPU offload, which change none of its numbers on CPU): clip_norm@4 off
# by 2.01 against 0.659 (ratio 1.91), as the emulation had landed 0.47 from float64 on clip_norm@3 where
# its reverse order and the engines landed 3.2 to 3.4 away (``harness.compare.tolerance.emulation_orders``).
BF16_ACCUM_WS4 = _case("builtin", model="transformer", precision="bf16", reference="local", use_orig_params=True,
                       world_size=4, steps=5, optimizer="two_optimizers", clip_grad="norm", grad_accum="no_sync",
                       activation_checkpointing="reentrant")


@pytest.mark.parametrize("case", [BF16_ACCUM_WS4], ids=lambda c: c.full_id)
def test_bf16_accumulated_clipped_transformer_at_world_size_4(pool4: RankPool, case: CaseConfig) -> None:
    record = _passes(pool4, case)
    assert record.detail["budget_source"] == "emulation"


# ---------------------------------------------------------------------------------------------------
# Full precision at 8 ranks: budgets from the reference's distance to float64


# Under torch's fixed fp32 defaults both FSDP1 engines failed this case identically:
# grad:transformer.decoder.layers.1.multihead_attn.out_proj.weight off by 1.06e-5 at step 4 against
# atol 1e-5 (ratio 1.001), with or without CPU offload; with the derived budgets the worst ratio is
# 0.53. torch FSDP1's numbers equal the built-in engine's at every world size measured, so the
# built-in engine alone keeps this file's time down.
FP32_WS8 = _case("builtin", model="transformer", reference="ddp", world_size=8, steps=5)


@pytest.mark.parametrize("case", [FP32_WS8], ids=lambda c: c.full_id)
def test_fp32_transformer_against_ddp_at_world_size_8(pool8: RankPool, case: CaseConfig) -> None:
    record = _passes(pool8, case)
    assert record.detail["budget_source"] == "reference"
    rtol, atol = DEFAULT_TOLERANCES[torch.float32]
    assert all(e.rtol == rtol and e.atol >= atol for e in record.errors), "a budget may only widen atol"
    assert any(e.atol > atol for e in record.errors), "no budget exceeded torch's atol: the case no longer tests the rule"


# Every reduced gradient shard of the built-in engine 1e-5 off (relative): measured worst ratio 18.5
# here (59 under torch's defaults), 2.4 (gpt) to 29 over the zoo's models at 4 and 8 ranks. A missing
# post-division measured 1.15e6, so the smaller bug is the one worth a test.
PLANTED_REL = 1e-5


@pytest.mark.parametrize("case", [FP32_WS8], ids=lambda c: c.full_id)
def test_planted_reduction_bug_fails_at_world_size_8(pool8: RankPool, case: CaseConfig) -> None:
    record = run_planted_case(pool8, case, PLANTED_REL)
    assert record.verdict == "fail", f"passed with a planted bug: worst ratio {record.worst_ratio}"
    assert record.detail["budget_source"] == "reference", "the bug must fail under the widened tolerance"
    assert any(e.name.startswith("grad:") and not e.passed for e in record.errors), record.reason
