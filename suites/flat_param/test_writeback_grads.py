"""Gradient writeback after ``zero_grad``: the flat gradient follows the original gradients, with no work
for gradients that are all gone.

With ``use_orig_params`` the optimizer sees the original parameters, whose gradients view the flat one;
``zero_grad(set_to_none=True)`` drops the views every step, and the next root pre-forward writes that back.
When every original gradient is None the flat gradient is dropped: zeroing its segments first (a kernel per
parameter at the start of every step, before the first all-gathers) is work with no effect.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.flat_param import FlatParamHandle
from harness.conformance.flat_handles import handle_kwargs


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _handle_with_grads() -> FlatParamHandle:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    handle = FlatParamHandle(list(model.parameters()), model,
                             **handle_kwargs(rank=0, world_size=1, use_orig_params=True, sharding="no_shard"))
    handle.shard()
    handle.flat_param.grad = torch.ones_like(handle.flat_param)
    handle.use_sharded_grad_views()
    assert all(p.grad is not None for p in handle._orig_params)
    return handle


def test_all_gradients_none_drop_the_flat_gradient_without_a_kernel() -> None:
    handle = _handle_with_grads()
    for p in handle._orig_params:
        p.grad = None
    with _Ops() as mode:
        handle.writeback_orig_params()
    assert handle.flat_param.grad is None
    assert not [op for op in mode.ops if "zero" in op or "fill" in op], mode.ops


def test_one_gradient_none_zeroes_its_segment_only() -> None:
    handle = _handle_with_grads()
    first = handle._orig_params[0]
    first.grad = None
    handle.writeback_orig_params()
    grad = handle.flat_param.grad
    assert grad is not None
    start, numel = handle.layout.param_offsets()[0], first.numel()
    assert torch.count_nonzero(grad[start : start + numel]) == 0
    assert torch.equal(grad[start + numel : start + numel + handle._orig_params[1].numel()],
                       torch.ones(handle._orig_params[1].numel()))
