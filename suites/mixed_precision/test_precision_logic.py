"""In-process checks of the pure parts: input casting, buffer dtypes, the handle's precision
switch, the emulating reference and the tolerance derivation. No rank processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.flat_param import FlatParamHandle, HandleShardingStrategy
from engine.precision import BufferPrecision, BufferState, cast_floating_tensors
from harness.case import PRECISIONS
from suites.mixed_precision.models import ParityNet
from suites.mixed_precision.reference import (
    CastPlan,
    EmulatingReference,
    compare_to_reference,
    derive_tolerance,
    float64_plan,
    predivide_factor,
    run_reference,
)
from suites.wrap.wrap_models import DummyProcessGroup



# ---------------------------------------------------------------------------- inputs
def test_cast_floating_tensors_leaves_integers_and_others() -> None:
    ids = torch.tensor([1, 2])
    mask = torch.tensor([True, False])
    x = torch.randn(2, requires_grad=True)
    out = cast_floating_tensors(((x, ids), {"m": mask, "n": 3, "s": "a"}), torch.float16)
    (cx, cids), kw = out
    assert cx.dtype == torch.float16 and cids is ids and kw["m"] is mask and kw["n"] == 3 and kw["s"] == "a"
    cx.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32  # the cast is differentiable


def test_cast_floating_tensors_none_is_identity() -> None:
    tree = (torch.randn(2),)
    assert cast_floating_tensors(tree, None) is tree


# ---------------------------------------------------------------------------- buffers
def test_buffer_precision_innermost_owner_wins_and_round_trips() -> None:
    shared = torch.ones(3, dtype=torch.float64)
    inner_only = torch.zeros(2)
    counter = torch.zeros((), dtype=torch.long)
    bp = BufferPrecision([([shared, inner_only, counter], None), ([shared], torch.float16)], torch.device("cpu"))
    assert len(bp) == 3 and bp.state == BufferState.ORIGINAL
    bp.to_compute()
    # ``shared`` belongs to the first (innermost) owner, whose buffer_dtype is None.
    assert (shared.dtype, inner_only.dtype, counter.dtype) == (torch.float64, torch.float32, torch.long)
    bp2 = BufferPrecision([([shared, counter], torch.bfloat16)], torch.device("cpu"))
    bp2.to_compute()
    assert shared.dtype == torch.bfloat16 and counter.dtype == torch.long  # integers never cast
    ref = shared  # the same tensor object throughout: modules keep their reference
    bp2.to_original()
    assert ref is shared and shared.dtype == torch.float64 and bp2.state == BufferState.ORIGINAL
    assert bp2.original_dtype(shared) == torch.float64 and bp2.original_dtype(torch.zeros(1)) is None


# ---------------------------------------------------------------------------- handle
def _handle(mp_param: torch.dtype | None, mp_reduce: torch.dtype | None, rank: int = 0) -> FlatParamHandle:
    module = nn.Linear(3, 5)
    handle = FlatParamHandle(
        list(module.parameters()), module, torch.device("cpu"), HandleShardingStrategy.FULL_SHARD,
        False, mp_param, mp_reduce, False, DummyProcessGroup(rank, 2), False,
    )
    handle.shard()
    handle.init_unsharded_flat_param()
    return handle


def test_handle_full_precision_switch() -> None:
    handle = _handle(torch.float16, None)
    low = handle.unsharded_flat_param
    assert (handle.param_dtype, handle.reduce_dtype, low.dtype) == (torch.float16, torch.float16, torch.float16)
    created = handle.set_full_precision(True)
    assert created is not None and created is handle.unsharded_flat_param and created.dtype == torch.float32
    assert (handle.param_dtype, handle.reduce_dtype) == (torch.float32, torch.float32)
    assert handle.set_full_precision(False) is None and handle.unsharded_flat_param is low
    assert handle.set_full_precision(True) is None and handle.unsharded_flat_param is created  # reused, not re-created
    assert created.untyped_storage().size() == 0 and low.untyped_storage().size() == 0  # both freed


def test_handle_full_precision_refuses_while_unsharded() -> None:
    handle = _handle(torch.float16, None)
    handle.alloc_unsharded_flat_param()
    with pytest.raises(RuntimeError, match="reshard first"):
        handle.set_full_precision(True)


def test_handle_reduce_only_switches_reduce_dtype_not_leaf() -> None:
    handle = _handle(None, torch.float16)
    leaf = handle.unsharded_flat_param
    assert handle.set_full_precision(True) is None and handle.unsharded_flat_param is leaf
    assert (handle.param_dtype, handle.reduce_dtype) == (torch.float32, torch.float32)


def test_handle_without_mixed_precision_never_forces() -> None:
    handle = _handle(None, None)
    handle.set_full_precision(True)
    assert not handle.force_full_precision


# ---------------------------------------------------------------------------- reference
def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _run(plan: CastPlan, world: int = 2, steps: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return run_reference(ParityNet(), plan, world, steps, ParityNet.input, ParityNet.loss, _sgd)


def test_predivide_factor_matches_fsdp1() -> None:
    # FSDP1 stops doubling when the factor no longer divides the world size or passes its root.
    assert [predivide_factor(w) for w in (1, 2, 4, 8, 16, 6)] == [1, 2, 2, 4, 4, 4]


def test_plan_from_spec_resolves_fsdp1_rules() -> None:
    plan = CastPlan.from_spec(PRECISIONS["param_buffer"])
    assert plan.reduce_dtype == torch.float16 and plan.compute_dtype == torch.float16  # reduce follows param
    plan = CastPlan.from_spec(PRECISIONS["reduce_only"])
    assert plan.compute_dtype == torch.float32 and plan.reduce_dtype == torch.float16
    with pytest.raises(ValueError, match="not a torch dtype"):
        CastPlan.from_spec(type("S", (), {"full": "float33", "param": None, "reduce": None, "buffer": None})())


def test_full_precision_emulation_is_plain_data_parallel_training() -> None:
    """Without casts, the emulation equals one model trained on all ranks' data (mean loss)."""
    torch.manual_seed(0)
    model = ParityNet()
    emulated = run_reference(model, CastPlan(full=torch.float32), 2, 3, ParityNet.input, ParityNet.loss, _sgd)
    opt = _sgd(model.parameters())
    for step in range(3):
        losses = [ParityNet.loss(model(*ParityNet.input(step, r))) for r in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(emulated[name], p.detach(), msg=name)


def test_emulation_keeps_master_and_optimizer_in_full_precision() -> None:
    torch.manual_seed(0)
    ref = EmulatingReference(ParityNet(), CastPlan.from_spec(PRECISIONS["fp16"]), 2, torch.optim.Adam)
    ref.step([ParityNet.input(0, r) for r in range(2)], ParityNet.loss)
    assert all(p.dtype == torch.float32 for p in ref.model.parameters())
    assert all(t.dtype == torch.float32 for s in ref.optimizer.state.values() for t in s.values() if t.is_floating_point())
    assert all(b["gain"].dtype == torch.float16 for b in ref.rank_buffers)


@pytest.mark.parametrize("precision", [p for p, spec in PRECISIONS.items() if spec.is_mixed])
def test_low_precision_is_measurably_away_from_fp64(precision: str) -> None:
    """Each mixed config's emulation differs from float64 by more than the floor, so the derived
    tolerance is set by the casts themselves (and is not just the floor)."""
    plan = CastPlan.from_spec(PRECISIONS[precision])
    emulated, fp64 = _run(plan), _run(float64_plan())
    tol = derive_tolerance(emulated, fp64, plan.full)
    assert tol.distance_to_fp64 * tol.factor > tol.floor, tol
    # The float64 run itself (what an engine dropping the casts approximates) fails the comparison.
    assert not compare_to_reference(fp64, emulated, tol).passed


def test_derive_tolerance_factor_must_be_below_one() -> None:
    p = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        derive_tolerance(p, p, torch.float32, factor=1.0)


def test_derive_tolerance_floor_applies_when_identical() -> None:
    p = {"w": torch.full((2,), 4.0)}
    tol = derive_tolerance(p, {"w": p["w"].double()}, torch.float32)
    assert tol.distance_to_fp64 == 0 and tol.atol == tol.floor == pytest.approx(32 * torch.finfo(torch.float32).eps * 4.0)


def test_compare_names_must_match() -> None:
    tol = derive_tolerance({"w": torch.zeros(1)}, {"w": torch.zeros(1)}, torch.float32)
    with pytest.raises(ValueError, match="parameter names differ"):
        compare_to_reference({"v": torch.zeros(1)}, {"w": torch.zeros(1)}, tol)
