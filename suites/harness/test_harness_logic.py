"""Pure logic of the harness: comparison and tolerances, knob checks on synthetic traces, verdicts,
device assignment and name mapping. No processes."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.cases.case import PRECISIONS, CaseConfig
from harness.cases.records import QuantityError
from harness.compare.compare import Finding, Observation, compare_observations, compare_tensors, derive_budgets, merge_quantities
from harness.compare.knobs import KnobCheck, check_backward_prefetch_structure, check_offload, check_order_changed, check_precision, check_sharding, check_use_orig_params
from harness.compare.parity import RankResult, record_from_outcome
from harness.compare.tolerance import DEFAULT_TOLERANCES, TolerancePolicy
from harness.compare.trace import CommEvent, movable_gathers, ops, signature, total_bytes
from harness.engines.adapters import ParamSlice, canonical_name
from harness.engines.references import gradient_divide_factors, reduce_shard_size, sum_over_ranks
from harness.ranks.placement import assign_devices, default_shard_size, hybrid_group_ranks, xdist_worker
from harness.ranks.pool import PoolOutcome, RankError

# ---------------------------------------------------------------------------------------------------
# compare_tensors against torch.testing.assert_close


def test_equal_tensors_have_zero_error() -> None:
    t = torch.randn(10)
    e = compare_tensors("x", t, t.clone(), 1e-5, 1.3e-6)
    assert (e.max_abs, e.max_rel, e.ratio, e.passed) == (0.0, 0.0, 0.0, True)


def test_bitwise_equal_tensors_short_cut_to_what_the_element_wise_path_gives() -> None:
    """Equal tensors skip the element-wise path; signed zeros and infinities are equal there too, a NaN never."""
    same = compare_tensors("x", torch.tensor([0.0, -0.0, float("inf"), 3.0]), torch.tensor([-0.0, 0.0, float("inf"), 3.0]), 0.0, 0.0)
    assert (same.max_abs, same.max_rel, same.ratio, same.passed) == (0.0, 0.0, 0.0, True)
    nan = compare_tensors("x", torch.tensor([float("nan"), 3.0]), torch.tensor([float("nan"), 3.0]), 1e-5, 1e-5)
    assert (nan.max_abs, nan.ratio, nan.passed) == (math.inf, math.inf, False)


def _by_definition(a: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, float]:
    """max_abs, max_rel and ratio element by element, as written out (what ``compare_tensors`` computes)."""
    diffs, rels, ratios = [], [], []
    for x, y in zip(a.tolist(), e.tolist()):
        if x == y:
            d = 0.0
        elif math.isfinite(x) and math.isfinite(y):
            d = abs(x - y)
        else:
            d = math.inf
        scale = abs(y) if math.isfinite(y) else 0.0
        rels.append(d / max(scale, 1e-300) if scale > 0 else (math.inf if d > 0 else 0.0))
        allowed = atol + rtol * scale
        ratios.append((d / allowed if allowed > 0 else math.inf) if d > 0 else 0.0)
        diffs.append(d)
    return max(diffs), max(rels), max(ratios)


SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-310, 1.0, -2.5]


@given(st.lists(st.tuples(st.floats(-1e6, 1e6) | st.sampled_from(SPECIAL), st.floats(-1e6, 1e6) | st.sampled_from(SPECIAL)),
                min_size=1, max_size=12),
       st.sampled_from([(1e-5, 1.3e-6), (0.0, 0.0), (0.0, 1e-3), (1e-3, 0.0)]))
def test_the_tensor_path_computes_the_definition(pairs: list[tuple[float, float]], tolerances: tuple[float, float]) -> None:
    a = torch.tensor([x for x, _ in pairs], dtype=torch.float64)
    e = torch.tensor([y for _, y in pairs], dtype=torch.float64)
    error = compare_tensors("x", a, e, *tolerances)
    assert (error.max_abs, error.max_rel, error.ratio) == _by_definition(a, e, *tolerances)
    assert error.passed is (error.ratio <= 1.0)


def test_error_fields() -> None:
    e = compare_tensors("x", torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), atol=0.1, rtol=0.1)
    assert e.max_abs == pytest.approx(0.5)
    assert e.max_rel == pytest.approx(0.25)
    assert e.ratio == pytest.approx(0.5 / (0.1 + 0.1 * 2.0))
    assert not e.passed


@pytest.mark.parametrize("actual,expected,passed", [
    ([float("nan")], [float("nan")], False),
    ([float("nan")], [1.0], False),
    ([float("inf")], [float("inf")], True),
    ([float("inf")], [float("-inf")], False),
    ([1.0, 2.0], [1.0], False),
])
def test_special_values_and_shapes(actual: list[float], expected: list[float], passed: bool) -> None:
    assert compare_tensors("x", torch.tensor(actual), torch.tensor(expected), 1e-5, 1e-5).passed is passed


@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=8),
    st.lists(st.floats(-1e-2, 1e-2, allow_nan=False), min_size=8, max_size=8),
)
def test_ratio_decides_like_assert_close(values: list[float], noise: list[float]) -> None:
    expected = torch.tensor(values, dtype=torch.float64)
    actual = expected + torch.tensor(noise[: len(values)], dtype=torch.float64)
    atol, rtol = 1e-3, 1e-4
    error = compare_tensors("x", actual, expected, atol, rtol)
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
        close = True
    except AssertionError:
        close = False
    # Exactly at the boundary float rounding may go either way; elsewhere both must agree.
    if abs(error.ratio - 1.0) > 1e-9:
        assert error.passed == close


def test_tolerance_policy_defaults_and_budgets() -> None:
    fp32 = TolerancePolicy.for_precision(PRECISIONS["fp32"])
    assert (fp32.rtol, fp32.atol) == DEFAULT_TOLERANCES[torch.float32]
    bf16 = TolerancePolicy.for_precision(PRECISIONS["bf16"], {"loss@0": 0.5, "grad:w": 1e-9}, "emulation")
    assert bf16.rtol == DEFAULT_TOLERANCES[torch.bfloat16][0]
    # Up to two ranks the full dtype's rtol: bfloat16's 1.6e-2 would pass a dropped cast (harness.compare.tolerance).
    assert TolerancePolicy.for_precision(PRECISIONS["bf16"], source="ablation").rtol == DEFAULT_TOLERANCES[torch.float32][0]
    assert bf16.tolerance("loss@0") == (0.5, bf16.rtol)
    assert bf16.tolerance("grad:w")[0] == DEFAULT_TOLERANCES[torch.float32][1]  # never below the default
    assert bf16.tolerance("param:other")[0] == DEFAULT_TOLERANCES[torch.float32][1]


def _obs(loss: float, grad: list[float], param: list[float], start: int = 0) -> Observation:
    return Observation(
        losses=[loss], grad_norms=[math.sqrt(sum(g * g for g in grad))],
        grads=[[ParamSlice("w", start, torch.tensor(grad))]], params=[ParamSlice("w", start, torch.tensor(param))],
    )


def test_compare_observations_matches_shards_to_reference_slices() -> None:
    reference = _obs(1.0, [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0])
    shard = Observation(
        losses=[1.0], grad_norms=reference.grad_norms,
        grads=[[ParamSlice("w", 2, torch.tensor([3.0, 4.5]))]], params=[ParamSlice("w", 2, torch.tensor([0.0, 0.0]))],
    )
    found = {f.error.name: f for f in compare_observations(shard, reference, TolerancePolicy(1e-6, 1e-6))}
    assert found["loss@0"].error.passed and found["param:w"].error.passed
    assert not found["grad:w"].error.passed and found["grad:w"].error.max_abs == pytest.approx(0.5)
    assert found["grad:w"].step == 0


def test_a_piece_of_an_unknown_parameter_or_an_uncovered_one_fails() -> None:
    reference = _obs(1.0, [1.0], [0.0])
    stranger = Observation(losses=[1.0], grad_norms=reference.grad_norms, grads=[[ParamSlice("v", 0, torch.tensor([1.0]))]])
    found = {f.error.name: f.error for f in compare_observations(stranger, reference, TolerancePolicy(1e-6, 1e-6))}
    assert not found["grad:v"].passed and math.isinf(found["grad:v"].ratio)
    gap = Observation(losses=[1.0], grad_norms=reference.grad_norms, grads=[[]], coverage_gaps={"w": 1})
    found = {f.error.name: f.error for f in compare_observations(gap, reference, TolerancePolicy(1e-6, 1e-6))}
    assert not found["grad:w"].passed


def test_derived_budgets_scale_the_emulation_error() -> None:
    truth = _obs(1.0, [1.0, 2.0], [0.5, 0.5])
    emulated = _obs(1.01, [1.0, 2.02], [0.5, 0.49])
    budgets = derive_budgets(emulated, truth, factor=4.0)
    assert budgets["loss@0"] == pytest.approx(0.04)
    assert budgets["grad:w"] == pytest.approx(0.08)
    assert budgets["param:w"] == pytest.approx(0.04)


def test_gradient_divide_factors_split_the_world_size() -> None:
    for ws in (1, 2, 3, 4, 8, 16, 6):
        pre, post = gradient_divide_factors(ws)
        assert pre * post == pytest.approx(ws)
    assert gradient_divide_factors(2) == (2.0, 1.0)
    assert gradient_divide_factors(8) == (4.0, 2.0)


def test_hybrid_gradients_are_summed_within_shard_groups_then_across_replicas() -> None:
    # bfloat16 keeps 8 significant bits: 1 + 2**-8 rounds back to 1, 1 + 2**-7 does not. Summed rank after
    # rank the small terms vanish one by one; summed in pairs (the shard groups) they survive as 2**-7.
    grads = [torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0**-8]), torch.tensor([2.0**-8])]
    flat = sum_over_ranks(grads, torch.bfloat16, 1.0)
    grouped = sum_over_ranks(grads, torch.bfloat16, 1.0, shard_size=2)
    assert flat.item() == 1.0 and grouped.item() == 1.0 + 2.0**-7
    assert sum_over_ranks(grads, torch.float64, 1.0, shard_size=2).item() == 1.0 + 2.0**-7
    assert sum_over_ranks(grads, torch.bfloat16, 2.0).item() == 0.5, "pre-divided before the sum"

    hybrid = CaseConfig(sharding_strategy="hybrid_shard", world_size=4)
    assert reduce_shard_size(hybrid, 4) == 2 and reduce_shard_size(hybrid.replace(sharding_strategy="hybrid_shard_zero2"), 4) == 2
    assert reduce_shard_size(hybrid, 4, local_world_size=2) == 2, "a node of 2 GPUs is the shard group"
    assert reduce_shard_size(hybrid, 2) is None, "one group: one sum"
    assert reduce_shard_size(hybrid.replace(sharding_strategy="full_shard"), 4) is None
    assert reduce_shard_size(hybrid.replace(extras=(("shard_size", 1),)), 4) == 1


def test_the_reversed_order_sums_the_last_rank_first() -> None:
    # Rank after rank the two 2**-8 vanish into 1 one by one; from the last rank they first add up to 2**-7,
    # which survives: past two ranks the order alone changes a bfloat16 sum.
    grads = [torch.tensor([1.0]), torch.tensor([2.0**-8]), torch.tensor([2.0**-8])]
    assert sum_over_ranks(grads, torch.bfloat16, 1.0).item() == 1.0
    assert sum_over_ranks(grads, torch.bfloat16, 1.0, order="reversed").item() == 1.0 + 2.0**-7
    # Reversed, the shard groups keep their ranks, (3 + 2) + (1 + 0), where ((3 + 2) + 1) + 0 loses both 2**-8.
    four = [torch.tensor([2.0**-8]), torch.tensor([2.0**-8]), torch.tensor([1.0]), torch.tensor([0.0])]
    assert sum_over_ranks(four, torch.bfloat16, 1.0, order="reversed").item() == 1.0
    assert sum_over_ranks(four, torch.bfloat16, 1.0, shard_size=2, order="reversed").item() == 1.0 + 2.0**-7
    two = [torch.tensor([1.0]), torch.tensor([2.0**-7 + 2.0**-9])]
    backwards = sum_over_ranks(two, torch.bfloat16, 1.0, order="reversed")
    assert torch.equal(backwards, sum_over_ranks(two, torch.bfloat16, 1.0)), "two terms commute"
    with pytest.raises(ValueError, match="order"):
        sum_over_ranks(grads, torch.bfloat16, 1.0, order="ring")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# merging ranks and the verdict


def _finding(name: str, ratio: float, passed: bool, step: int | None = 0) -> Finding:
    return Finding(QuantityError(name, ratio * 1e-5, ratio, 1e-5, 0.0, passed, ratio), step)


def test_merge_keeps_the_worst_rank_and_ands_the_verdicts() -> None:
    errors, where = merge_quantities([[_finding("loss@0", 0.5, True)], [_finding("loss@0", 3.0, False, 2)]])
    assert len(errors) == 1 and errors[0].ratio == 3.0 and not errors[0].passed
    assert where["loss@0"] == {"rank": 1, "step": 2}
    errors, _ = merge_quantities([[_finding("x", 3.0, False)], [_finding("x", 0.5, True)]])
    assert not errors[0].passed and errors[0].ratio == 3.0


def _rank_value(findings: list[Finding], knobs: list[KnobCheck] | None = None, **extra: object) -> RankResult:
    return RankResult(
        "ok", findings=findings, knobs=knobs or [], engine_s=0.1, reference_s=0.1, peak_mem_bytes=7,
        bytes_all_gathered=100, bytes_reduce_scattered=50, **extra,  # type: ignore[arg-type]
    )


def test_a_rank_result_survives_pickling() -> None:
    value = _rank_value([_finding("loss@0", 0.0, True)], [KnobCheck("precision", "ok", "")], budget_source="ablation")
    assert pickle.loads(pickle.dumps(value)) == value


CASE = CaseConfig()


def test_record_pass() -> None:
    value = _rank_value([_finding("loss@0", 0.0, True)], [KnobCheck("precision", "ok", "")])
    record = record_from_outcome(CASE, PoolOutcome("ok", [value, value], wall_s=0.5))
    assert record.verdict == "pass" and record.reason == ""
    assert record.bytes_all_gathered == 100 and record.bytes_reduce_scattered == 50 and record.wall_s == 0.5
    assert record.case == CASE.to_dict() and record.case_id == CASE.case_id


def test_record_fail_names_the_worst_quantity_step_and_rank() -> None:
    good = _rank_value([_finding("grad:w", 0.1, True, 1)])
    bad = _rank_value([_finding("grad:w", 12.0, False, 3)])
    record = record_from_outcome(CASE, PoolOutcome("ok", [good, bad]))
    assert record.verdict == "fail"
    assert "grad:w" in record.reason and "step 3" in record.reason and "rank 1" in record.reason


def test_record_fails_on_an_ignored_knob_and_on_nondeterminism() -> None:
    knob = [KnobCheck("backward_prefetch", "ignored", "same order")]
    ok = [_finding("loss@0", 0.0, True)]
    record = record_from_outcome(CASE, PoolOutcome("ok", [_rank_value(ok, knob), _rank_value(ok)]))
    assert record.verdict == "fail" and "knob backward_prefetch ignored" in record.reason
    nondet = _rank_value(ok, deterministic=False, nondeterminism="losses differ")
    record = record_from_outcome(CASE, PoolOutcome("ok", [nondet, _rank_value(ok, deterministic=True)]))
    assert record.verdict == "fail" and record.deterministic is False and "losses differ" in record.reason


def test_record_with_nothing_compared_fails() -> None:
    record = record_from_outcome(CASE, PoolOutcome("ok", [_rank_value([]), _rank_value([])]))
    assert record.verdict == "fail" and "nothing was compared" in record.reason


def test_record_unsupported() -> None:
    value = RankResult("unsupported", "no NO_SHARD")
    record = record_from_outcome(CASE, PoolOutcome("ok", [value, value]))
    assert (record.verdict, record.reason) == ("unsupported", "no NO_SHARD")


@pytest.mark.parametrize("status", ["timeout", "crash", "error"])
def test_record_of_a_pool_failure_keeps_the_evidence(status: str) -> None:
    outcome = PoolOutcome(
        status, [None, None], reason=f"the {status}", errors={1: RankError(1, "ValueError", "bad", "Traceback...")},
        stacks={0: "Current thread ...", 1: "Thread ..."}, exit_codes={1: -11}, stderr_tails={1: "Segmentation fault"},
        wall_s=5.0,
    )
    record = record_from_outcome(CASE, outcome)
    assert (record.verdict, record.reason, record.wall_s) == (status, f"the {status}", 5.0)
    assert record.detail["stacks"] == {"0": "Current thread ...", "1": "Thread ..."}
    assert record.detail["exit_codes"] == {"1": -11}
    assert record.detail["tracebacks"] == {"1": "Traceback..."}
    assert record.detail["stderr_tails"] == {"1": "Segmentation fault"}


# ---------------------------------------------------------------------------------------------------
# knob checks on synthetic traces


def ev(op: str, phase: str, step: int = 0, numel: int = 8, dtype: str = "float32", group: int = 2, name: str = "",
       ranks: tuple[int, ...] = ()) -> CommEvent:
    size = len(ranks) if ranks else group
    return CommEvent(op, name or op, numel, numel * 4, dtype, size, phase, step, ranks)  # type: ignore[arg-type]


FULL_SHARD = [ev("all_gather", "forward"), ev("all_gather", "forward", numel=4), ev("all_gather", "backward", numel=4),
              ev("reduce_scatter", "backward", numel=4), ev("reduce_scatter", "backward")]
SHARD_GRAD_OP = [ev("all_gather", "forward"), ev("reduce_scatter", "backward")]
NO_SHARD = [ev("all_reduce", "backward")]


@pytest.mark.parametrize("strategy,trace,status", [
    ("full_shard", FULL_SHARD, "ok"),
    ("full_shard", SHARD_GRAD_OP, "ignored"),
    ("shard_grad_op", SHARD_GRAD_OP, "ok"),
    ("shard_grad_op", FULL_SHARD, "ignored"),
    ("no_shard", NO_SHARD, "ok"),
    ("no_shard", FULL_SHARD, "ignored"),
    ("hybrid_shard", FULL_SHARD, "ok"),
])
def test_check_sharding(strategy: str, trace: list[CommEvent], status: str) -> None:
    assert check_sharding(strategy, trace, sharded_units=2).status == status


def test_check_sharding_edge_cases() -> None:
    assert check_sharding("full_shard", SHARD_GRAD_OP, sharded_units=0).status == "n/a"
    # One rank gathers and reduces nothing whatever the strategy; the same empty trace on two is ignored.
    assert check_sharding("full_shard", [], sharded_units=2, world_size=1).status == "n/a"
    assert check_sharding("full_shard", [], sharded_units=2, world_size=2).status == "ignored"
    # One-rank groups (rank-local experts) move nothing and do not count.
    local_only = [ev("all_gather", "forward", group=1), ev("reduce_scatter", "backward", group=1)]
    assert check_sharding("shard_grad_op", local_only, sharded_units=1).status == "ignored"


def _on_groups(trace: list[CommEvent], ranks: tuple[int, ...]) -> list[CommEvent]:
    return [replace(e, group_ranks=ranks, group_size=len(ranks)) for e in trace]


def test_check_sharding_hybrid_reads_the_groups_ranks() -> None:
    """Rank 0 of a 2 x 2 topology: shard group [0, 1], replicas [0, 2]. Sizes alone cannot tell a
    2-rank shard group from a 2-rank replica group; the recorded ranks can."""
    groups = hybrid_group_ranks(0, 4, 2)
    assert groups == ((0, 1), (0, 2))
    within = _on_groups(FULL_SHARD, (0, 1))
    good = within + [ev("all_reduce", "backward", ranks=(0, 2))]
    assert check_sharding("hybrid_shard", good, sharded_units=2, hybrid_groups=groups, world_size=4).status == "ok"
    # No all-reduce across replicas: each replica trains alone.
    assert check_sharding("hybrid_shard", within, sharded_units=2, hybrid_groups=groups, world_size=4).status == "ignored"
    # The all-reduce on the shard group's ranks (right size, wrong group).
    wrong_reduce = within + [ev("all_reduce", "backward", ranks=(0, 1))]
    assert check_sharding("hybrid_shard", wrong_reduce, sharded_units=2, hybrid_groups=groups, world_size=4).status == "ignored"
    # Gathers over the replica group instead of the shard group.
    crossed = _on_groups(FULL_SHARD, (0, 2)) + [ev("all_reduce", "backward", ranks=(0, 2))]
    check = check_sharding("hybrid_shard", crossed, sharded_units=2, hybrid_groups=groups, world_size=4)
    assert check.status == "ignored" and "on ranks [0, 2]" in check.reason
    # Events recorded without ranks are judged by size, as before ranks were recorded.
    sized = FULL_SHARD + [ev("all_reduce", "backward", group=2)]
    assert check_sharding("hybrid_shard", sized, sharded_units=2, hybrid_groups=groups, world_size=4).status == "ok"
    # One rank per shard group (2 replicas of one rank): only the replicas' all-reduce averages.
    single = hybrid_group_ranks(1, 2, 1)
    assert single == ((1,), (0, 1))
    for strategy in ("hybrid_shard", "hybrid_shard_zero2"):
        assert check_sharding(strategy, NO_SHARD, sharded_units=2, hybrid_groups=single, world_size=2).status == "ok"
        assert check_sharding(strategy, [], sharded_units=2, hybrid_groups=single, world_size=2).status == "ignored"


def test_check_sharding_zero_takes_the_sync_after_the_step_or_in_the_next_forward() -> None:
    """ZeRO-1/2: never gathered in backward; the updated partitions are gathered right after the step
    (DeepSpeed) or in the next forward (Megatron-FSDP, whose first forward also gathers its buffer)."""
    reduce = [ev("reduce_scatter", "backward", step=s) for s in range(3)]
    eager = reduce + [ev("all_gather", "step", step=s) for s in range(3)]
    lazy = reduce + [ev("all_gather", "forward", step=s) for s in range(3)]
    for strategy in ("zero1", "zero2"):
        assert check_sharding(strategy, eager, sharded_units=2).status == "ok"
        assert check_sharding(strategy, lazy, sharded_units=2).status == "ok"
    # Re-gathered in backward (FULL_SHARD's trace), never synced (NO_SHARD's), or never reduced.
    check = check_sharding("zero2", eager + [ev("all_gather", "backward", step=1)], sharded_units=2)
    assert check.status == "ignored" and "backward all-gathers 1" in check.reason
    assert check_sharding("zero2", FULL_SHARD, sharded_units=2).status == "ignored"
    assert check_sharding("zero1", reduce, sharded_units=2).status == "ignored"
    assert check_sharding("zero1", [ev("all_gather", "step", step=0)], sharded_units=2).status == "ignored"


def test_check_precision() -> None:
    bf16 = PRECISIONS["bf16"]
    good = [ev("all_gather", "forward", dtype="bfloat16"), ev("reduce_scatter", "backward", dtype="bfloat16"),
            ev("all_reduce", "backward", dtype="int32")]
    assert check_precision(bf16, good).status == "ok"
    check = check_precision(bf16, [ev("all_gather", "forward", dtype="bfloat16"), ev("reduce_scatter", "backward")])
    assert check.status == "ignored" and "float32" in check.reason and "bfloat16" in check.reason
    assert check_precision(PRECISIONS["reduce_only"], [ev("all_gather", "forward"), ev("reduce_scatter", "backward", dtype="float16")]).status == "ok"
    assert check_precision(PRECISIONS["fp32"], []).status == "n/a"


def test_check_order_changed() -> None:
    none = [ev("all_gather", "backward", numel=4), ev("reduce_scatter", "backward", numel=4),
            ev("all_gather", "backward", numel=8), ev("reduce_scatter", "backward", numel=8)]
    pre = [none[0], none[2], none[1], none[3]]
    steps = range(2)
    assert check_order_changed("backward_prefetch", "pre", "none", pre, none, phase="backward", steps=steps).status == "ok"
    assert check_order_changed("backward_prefetch", "pre", "none", none, none, phase="backward", steps=steps).status == "ignored"
    single = none[:2]
    assert check_order_changed("backward_prefetch", "pre", "none", single, single, phase="backward", steps=steps).status == "n/a"
    # Compute markers count: a forward prefetch moves an all-gather before the compute it precedes.
    plain = [ev("all_gather", "forward", 1), ev("compute", "forward", 1, name="a"), ev("all_gather", "forward", 1, numel=4),
             ev("compute", "forward", 1, name="b")]
    early = [plain[0], plain[2], plain[1], plain[3]]
    assert check_order_changed("forward_prefetch", True, False, early, plain, phase="forward", steps=steps).status == "ok"
    # Steps outside the window are not compared.
    assert check_order_changed("forward_prefetch", True, False, early, plain, phase="forward", steps=range(1)).status == "n/a"


def test_check_backward_prefetch_structure() -> None:
    prefetching = [ev("all_gather", "backward"), ev("all_gather", "backward", numel=4), ev("reduce_scatter", "backward")]
    waiting = [ev("all_gather", "backward"), ev("reduce_scatter", "backward"), ev("all_gather", "backward", numel=4)]
    assert check_backward_prefetch_structure(prefetching, range(1)).status == "ok"
    assert check_backward_prefetch_structure(waiting, range(1)).status == "ignored"
    assert check_backward_prefetch_structure(waiting[:2], range(1)).status == "n/a"


def test_check_offload_and_use_orig_params() -> None:
    assert check_offload(True, {"cpu"}, "cpu").status == "n/a"
    assert check_offload(True, {"cpu"}, "cuda").status == "ok"
    assert check_offload(True, {"cuda"}, "cuda").status == "ignored"
    assert check_offload(False, {"cuda"}, "cuda").status == "ok"
    assert check_offload(False, {"cpu"}, "cuda").status == "ignored"
    assert check_use_orig_params(False, True).status == "ok"
    assert check_use_orig_params(True, False).status == "ok"
    assert check_use_orig_params(True, True).status == "ignored"
    assert check_use_orig_params(False, None).status == "n/a"


def test_trace_queries() -> None:
    trace = FULL_SHARD + [ev("all_gather", "forward", group=1), ev("compute", "forward", name="m")]
    assert len(ops(trace, op="all_gather")) == 3  # the one-rank group is dropped, markers are not ops
    assert len(ops(trace, op="all_gather", min_group=1)) == 4
    assert total_bytes(trace, "all_gather") == (8 + 4 + 4) * 4
    sig = signature(trace, phase="forward", steps=range(1))
    assert sig[-1] == (0, "compute", "m") and (0, "all_gather", 8, 1) in sig  # one-rank groups keep their place


def test_movable_gathers() -> None:
    assert movable_gathers([(0, "all_gather", 4, 2), (0, "reduce_scatter", 4, 2), (1, "all_gather", 4, 2)]) == 0
    assert movable_gathers([(0, "all_reduce", 4, 1), (0, "all_gather", 4, 2), (0, "all_gather", 8, 2)]) == 2


# ---------------------------------------------------------------------------------------------------
# names, devices, groups


@pytest.mark.parametrize("raw,clean", [
    ("_fsdp_wrapped_module.module.1._fsdp_wrapped_module.0.weight", "module.1.0.weight"),
    ("layers.0._checkpoint_wrapped_module.w", "layers.0.w"),
    ("module.0.weight", "module.0.weight"),
])
def test_canonical_name(raw: str, clean: str) -> None:
    assert canonical_name(raw) == clean


def test_assign_devices_is_disjoint_per_worker_where_blocks_fit_and_shared_where_not() -> None:
    sets = [set(assign_devices(2, 8, worker, 4)) for worker in range(4)]
    assert set().union(*sets) == set(range(8)) and sum(map(len, sets)) == 8
    assert [assign_devices(2, 4, w, 3) for w in range(3)] == [(0, 1), (2, 3), (0, 1)]
    # Fewer GPUs than ranks: rank r on GPU r mod n (gloo only: harness.ranks.placement.place).
    assert assign_devices(4, 2) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="n_devices=0"):
        assign_devices(2, 0)
    with pytest.raises(ValueError, match="worker_index=3"):
        assign_devices(1, 2, 3, 3)


def test_xdist_worker() -> None:
    assert xdist_worker({}) == (0, 1)
    assert xdist_worker({"PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (3, 4)


def test_default_shard_size() -> None:
    assert default_shard_size(2) == 2
    assert default_shard_size(4) == 2
    assert default_shard_size(16, local_world_size=8) == 8
    assert default_shard_size(3) == 3


def test_the_torch_common_fsdp_check_skips_for_the_reason_that_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    import harness.pytest_plugin as plugin

    name = "harness.conformance.torch_common_fsdp"
    monkeypatch.delitem(sys.modules, name, raising=False)
    # On CPU the reason is the missing GPU, whether torch's testing extras import or not.
    monkeypatch.setattr(plugin, "gpus_missing", lambda n, why="": f"needs {n} CUDA GPU(s); this machine has 0")
    with pytest.raises(pytest.skip.Exception, match=r"needs 1 CUDA GPU\(s\); this machine has 0") as info:
        importlib.import_module(name)
    assert "expecttest" not in str(info.value)
    # With a GPU, an extra that does not import is named by its own import error, not guessed.
    monkeypatch.setattr(plugin, "gpus_missing", lambda n, why="": None)
    monkeypatch.setitem(sys.modules, "torch.testing._internal.common_fsdp", None)
    with pytest.raises(pytest.skip.Exception, match=r"torch's testing extras do not import \(.*common_fsdp.*None in sys.modules"):
        importlib.import_module(name)


# ---------------------------------------------------------------------------------------------------
# The gradient norm from every rank's pieces (harness.compare.training)


def test_the_norm_counts_a_replicated_piece_once_and_names_what_no_rank_holds() -> None:
    from harness.compare.training import ParamInfo, _norm_and_gaps

    table = {"w": ParamInfo(4, True, False), "local": ParamInfo(2, True, True), "frozen": ParamInfo(3, False, False),
             "b": ParamInfo(2, True, False)}
    # Two ranks hold w's first half (replicas), one its second half; nobody holds b.
    shared = [[("w", 0, 2, 1.0), ("w", 2, 2, 4.0)], [("w", 0, 2, 1.0)]]
    norm, gaps = _norm_and_gaps(shared, [("local", 0, 2, 4.0)], table)
    assert norm == math.sqrt(1.0 + 4.0 + 4.0) and gaps == {"b": 2}
    # Overlapping pieces cover their union; a piece of a rank-local parameter counts as this rank's alone.
    norm, gaps = _norm_and_gaps([[("w", 0, 3, 1.0)], [("w", 1, 3, 2.0)], [("b", 0, 1, 0.0)]], [], table)
    assert norm == math.sqrt(3.0) and gaps == {"local": 2, "b": 1}
