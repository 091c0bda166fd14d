"""How gradients reach the unsharded flat parameter from the compute views: with one concatenation.

Compute reads one view per original parameter; autograd must route every view's gradient into the
one unsharded leaf. Views taken by one ``split`` give the leaf its gradient in a single
concatenation; views taken one ``narrow`` at a time would each materialize a gradient the size of
the whole flat buffer (zero-filled, then added), which made backward several times slower for units
with many parameters. Counted here: the backward ops whose output is as large as the flat buffer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.flat_param import FlatParamHandle
from harness.conformance.flat_handles import handle_kwargs


class FlatSizedOps(TorchDispatchMode):
    """Names of the ops that return a tensor of ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.numel() == self.numel for t in tree_leaves(out)):
            self.ops.append(str(func))
        return out


def _unit_backward(model: nn.Module, use_orig_params: bool) -> tuple[list[str], FlatParamHandle, list[torch.Tensor]]:
    params = [p.detach().clone() for p in model.parameters()]
    handle = FlatParamHandle(
        list(model.parameters()), model, **handle_kwargs(rank=0, world_size=1, use_orig_params=use_orig_params, sharding="no_shard")
    )
    handle.shard()
    leaf = handle.init_unsharded_flat_param(alias_flat_param=True)
    loss = sum((v * v).sum() for v in handle.unflat_views(leaf))
    with FlatSizedOps(leaf.numel()) as mode:
        loss.backward()
    return mode.ops, handle, params


def _expected_grad(handle: FlatParamHandle, params: list[torch.Tensor]) -> torch.Tensor:
    """d/dflat of sum(v*v): 2 * value at every parameter element, 0 on padding."""
    expected = torch.zeros(handle.layout.total_numel)
    for p, start in zip(params, handle.layout.param_offsets()):
        expected[start : start + p.numel()] = 2 * p.reshape(-1)
    return expected


def test_many_parameters_reach_the_leaf_in_one_concatenation() -> None:
    torch.manual_seed(0)
    ops, handle, params = _unit_backward(nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)]), use_orig_params=False)
    # 24 parameters; narrow-per-parameter views would give 24 flat-sized zero tensors and 23 adds.
    assert len(ops) <= 2, f"backward built {len(ops)} flat-sized tensors: {ops}"
    torch.testing.assert_close(handle.unsharded_flat_param.grad, _expected_grad(handle, params))


def test_alignment_padding_gets_a_zero_gradient() -> None:
    # use_orig_params aligns every parameter: odd sizes leave padding segments between them.
    torch.manual_seed(0)
    ops, handle, params = _unit_backward(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 3)), use_orig_params=True)
    assert any(handle.layout.is_padding_mask), "expected alignment padding in this layout"
    assert len(ops) <= 2, ops
    torch.testing.assert_close(handle.unsharded_flat_param.grad, _expected_grad(handle, params))
