"""In-process checks of the pure parts: input casting, buffer dtypes, the handle's precision
switch, and the harness's emulating reference and tolerance rule on ParityNet. No rank processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from engine.flat_param import FlatParamHandle, HandleShardingStrategy
from engine.precision import BufferPrecision, BufferState, cast_floating_tensors
from harness.cases.case import PRECISIONS, PrecisionSpec
from harness.compare.compare import Observation, measure_drift
from harness.compare.tolerance import mixed_precision_budgets
from harness.conformance.flat_handles import DummyProcessGroup
from harness.conformance.mixed_precision.models import ParityNet
from harness.engines.optim import sgd
from harness.engines.references import TRUTH_SPEC, LocalReference, cast_ablations

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "test_cast_floating_tensors_leaves_integers_and_others",
    "test_cast_floating_tensors_none_is_identity",
    "test_buffer_precision_innermost_owner_wins_and_round_trips",
    "test_handle_full_precision_switch",
    "test_handle_full_precision_refuses_while_unsharded",
    "test_handle_reduce_only_switches_reduce_dtype_not_leaf",
    "test_handle_without_mixed_precision_never_forces",
    "test_precision_spec_resolves_fsdp1_rules",
    "test_full_precision_emulation_is_plain_data_parallel_training",
    "test_emulation_keeps_master_and_optimizer_in_full_precision",
    "test_every_cast_of_parity_net_moves_the_numbers",
]


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


# ---------------------------------------------------------------------------- reference (the harness's)
def _reference(spec: PrecisionSpec, world: int = 2, steps: int = 3, model: ParityNet | None = None) -> LocalReference:
    torch.manual_seed(0)
    model = model if model is not None else ParityNet()
    return LocalReference(
        [model] * world, spec, torch.device("cpu"), steps=steps, lr=0.1, momentum=0.9,
        inputs=lambda step, r: model.get_input(seed=0, step=step, rank=r), loss=model.get_loss,
    )


def test_precision_spec_resolves_fsdp1_rules() -> None:
    spec = PRECISIONS["param_buffer"]
    assert (spec.compute, spec.reduced) == ("float16", "float16")  # reduce follows param
    spec = PRECISIONS["reduce_only"]
    assert (spec.compute, spec.reduced) == ("float32", "float16")
    with pytest.raises(ValueError, match="not a torch dtype"):
        _reference(PrecisionSpec(full="float33", param=None, reduce=None, buffer=None))


def test_full_precision_emulation_is_plain_data_parallel_training() -> None:
    """Without casts, the emulation equals one model trained on all ranks' data (mean loss)."""
    torch.manual_seed(0)
    model = ParityNet()
    twin = copy.deepcopy(model)
    emulated = _reference(PRECISIONS["fp32"], model=twin).run(0).params
    opt = sgd(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        losses = [model.get_loss((), model(*model.get_input(seed=0, step=step, rank=r))) for r in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(emulated[name], p.detach().reshape(-1), msg=name)


def test_emulation_keeps_master_and_optimizer_in_full_precision() -> None:
    ref = _reference(PRECISIONS["fp16"], steps=1)
    ref.run(0)
    assert all(p.dtype == torch.float32 for p in ref.shared.values())
    assert all(t.dtype == torch.float32 for o in ref.optimizers for s in o.state.values() for t in s.values() if t.is_floating_point())


@pytest.mark.parametrize("precision", [p for p, spec in PRECISIONS.items() if spec.is_mixed])
def test_every_cast_of_parity_net_moves_the_numbers(precision: str) -> None:
    """On ParityNet every cast a config sets changes the result by more than the tolerance allows,
    so dropping it fails the comparison: float64 and each ablation resolve on some quantity (but a
    buffer cast to the dtype the model casts it to anyway)."""
    spec = PRECISIONS[precision]
    emulated = Observation.from_reference(_reference(spec).run(0))
    others = {"fp64": Observation.from_reference(_reference(TRUTH_SPEC).run(0))}
    for name, ablated in cast_ablations(spec, has_float_buffers=True).items():
        others[name] = Observation.from_reference(_reference(ablated).run(0))
    drift = measure_drift(emulated, others)
    derived = mixed_precision_budgets(drift.distances, drift.scales, spec.full)
    # The model casts its gain to the activation dtype itself: a buffer dtype equal to it changes nothing.
    silent = {"no_buffer"} if spec.buffer == spec.compute else set()
    for name in set(others) - silent:
        assert any(name in b.resolvable for b in derived.values()), f"{precision}: {name} resolves nowhere"
