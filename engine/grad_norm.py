"""``clip_grad_norm_`` over sharded gradients: the norm of the full gradient, from every shard.

Sharded units hold disjoint parts of the gradient, so their ``sum |g|^p`` (or max for ``inf``)
is all-reduced over the shard group; replicated gradients (NO_SHARD units, parameters no unit
manages) are identical on every rank and are counted once, locally.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from engine.context import RootContext

__all__ = ["clip_grad_norm"]


def _norm_stat(grads: list[Tensor], p: float, device: torch.device) -> Tensor:
    """``sum |g|^p`` (``max |g|`` for ``inf``) in float32 over ``grads``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), p).to(device) for g in grads])
    return norms.max() if math.isinf(p) else norms.pow(p).sum()


def clip_grad_norm(root: nn.Module, group: Any, ctx: RootContext, max_norm: float, norm_type: float) -> Tensor:
    """Clip every gradient under ``root`` (the root instance, as a module; its units are
    ``ctx.units``) to a total norm of ``max_norm``; sharded gradients' statistics are all-reduced
    over ``group``. Returns the total norm before clipping, as FSDP1 returns it: in the largest gradient
dtype (float32 with a warning on a rank without gradients), on the CPU under CPU offload."""
    p = float(norm_type)
    if p <= 0 and not math.isinf(p):
        raise ValueError(f"norm_type={norm_type} must be positive or inf")
    sharded: list[Tensor] = []
    replicated: list[Tensor] = []
    managed: set[int] = set()
    for unit in ctx.units:
        handle = unit.handle
        managed.add(id(handle.flat_param))
        managed.update(id(q) for q in handle.orig_params)
        if handle.config.use_orig_params:
            grads = [q.grad for q in handle.orig_params if q.grad is not None]
        else:
            grads = [handle.flat_param.grad] if handle.flat_param.grad is not None else []
        (sharded if handle.uses_sharded_strategy else replicated).extend(grads)
    for q in root.parameters():
        if id(q) not in managed and q.grad is not None:
            replicated.append(q.grad)
    device = ctx.device
    local = _norm_stat(sharded, p, device)
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    dist.all_reduce(local, op=op, group=group)
    rest = _norm_stat(replicated, p, device)
    if math.isinf(p):
        total = torch.maximum(local, rest)
    else:
        total = (local + rest).pow(1.0 / p)
    offload = getattr(root, "cpu_offload", None)
    if offload is not None and offload.offload_params:
        # FSDP1 returns the norm where the offloaded gradients are.
        total = total.cpu()
    clip_coef = max_norm / (total + 1e-6)
    grads = sharded + replicated
    if clip_coef.item() < 1.0:
        for g in grads:
            g.detach().mul_(clip_coef.to(g.device, g.dtype))
    if not grads:
        # FSDP1's documented behaviour: without communication this rank cannot know the other ranks' dtype.
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank(group)} with no gradients -- returning the "
            f"total norm in the default dtype {total.dtype}",
            stacklevel=3,
        )
        return total
    # The "largest" gradient dtype (FSDP1: as if the local norms had not been forced to float32).
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))
