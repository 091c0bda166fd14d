"""Communication hooks: replace a unit's gradient reduction, with torch FSDP1's default hooks.

A hook registered with ``FSDP.register_comm_hook(state, hook)`` (on the root, for every unit) is
called instead of the built-in reduction, with torch FSDP1's two signatures:

- sharded strategies: ``hook(state, grad, output)``: ``grad`` is the padded unsharded gradient (in
  the reduce dtype), ``output`` a pre-sized tensor for this rank's reduced chunk;
- NO_SHARD: ``hook(state, grad)``, reducing ``grad`` in place.

The default hooks divide by ``gradient_predivide_factor`` before and ``gradient_postdivide_factor``
after the collective (their product is the world size), so a low-precision sum does not overflow.
The compression hooks communicate in fp16/bf16 and cast the result back to ``parameter_type``; the
unsharded gradient reaches them uncast (torch FSDP1 skips its reduce-dtype cast for them).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from engine import collectives

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "is_low_precision_hook",
    "reduce_scatter_hook",
    "run_comm_hook",
]


class DefaultState:
    """The process group a default hook reduces over and its division factors."""

    __slots__ = ["process_group", "world_size", "gradient_predivide_factor", "gradient_postdivide_factor"]

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        if process_group is None:
            raise ValueError(f"Expected to pass in an explicit ProcessGroup to {type(self).__name__}: pass the group to reduce over")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_predivide_factor, self.gradient_postdivide_factor = collectives.average_factors(self.world_size)


class LowPrecisionState(DefaultState):
    """:class:`DefaultState` plus the dtype the compression hooks cast the reduced gradient back to."""

    __slots__ = ["parameter_type"]

    def __init__(self, process_group: dist.ProcessGroup, parameter_type: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: Tensor) -> None:
    """Average ``grad`` in place across ``state.process_group`` (pre- and post-divided)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    dist.all_reduce(grad, group=state.process_group)
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: Tensor, output: Tensor) -> None:
    """Reduce-scatter ``grad`` into ``output`` (this rank's chunk), pre- and post-divided."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    dist.reduce_scatter_tensor(output, grad, group=state.process_group)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _low_precision_hook(prec: torch.dtype, state: LowPrecisionState, grad: Tensor, output: Tensor | None) -> None:
    if grad.dtype != prec:
        grad.data = grad.data.to(prec)
    if output is not None:
        if output.dtype != prec:
            output.data = output.data.to(prec)
        reduce_scatter_hook(state, grad, output)
        output.data = output.data.to(state.parameter_type)
    else:
        allreduce_hook(state, grad)
        grad.data = grad.data.to(state.parameter_type)


def fp16_compress_hook(state: LowPrecisionState, grad: Tensor, output: Tensor | None = None) -> None:
    """Communicate in float16, then cast back to ``state.parameter_type``."""
    return functools.partial(_low_precision_hook, torch.float16)(state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: Tensor, output: Tensor | None = None) -> None:
    """Communicate in bfloat16, then cast back to ``state.parameter_type``."""
    return functools.partial(_low_precision_hook, torch.bfloat16)(state, grad, output)


def is_low_precision_hook(hook: Callable[..., Any]) -> bool:
    """Ours or torch's compression hooks (recognized by name): they receive the gradient uncast."""
    return hook in (fp16_compress_hook, bf16_compress_hook) or getattr(hook, "__name__", "") in (
        "fp16_compress_hook",
        "bf16_compress_hook",
    )


def run_comm_hook(
    hook: Callable[..., Any],
    hook_state: Any,
    unsharded_grad: Tensor,
    reduce_dtype: torch.dtype,
    sharded: bool,
    world_size: int,
    stream: torch.cuda.Stream | None,
) -> collectives.ReduceResult:
    """Reduce one unit's unsharded gradient with ``hook`` instead of the built-in collective."""
    with collectives.stream_context(stream):
        # A low-precision hook casts itself; every other hook gets the reduce dtype.
        dtype = unsharded_grad.dtype if is_low_precision_hook(hook) else reduce_dtype
        grad = collectives.reduction_input(unsharded_grad, dtype, stream)
        if sharded:
            output = collectives.chunk_output(grad, world_size, "communication hook")
            hook(hook_state, grad, output)
            result = output
        else:
            hook(hook_state, grad)
            result = grad
        event = collectives.record_event(stream)
    return collectives.ReduceResult(result, event)
