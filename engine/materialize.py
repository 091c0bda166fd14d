"""What construction does to the wrapped module's own states before they are flattened, as torch
FSDP1 does it: materialize meta-device states, move what is on the CPU to ``device_id``, and
broadcast rank 0's values (``sync_module_states``). "Own" states are those of the modules the
instance manages: nested instances and ignored modules are not entered."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from engine import collectives
from engine.module_tree import managed_modules

__all__ = ["FLATTENED", "managed_params", "materialize", "move_cpu_states", "sync_states"]

#: marks an original parameter some unit has flattened, so an enclosing unit skips it.
FLATTENED = "_fsdp_flattened"


def managed_params(module: nn.Module, ignored_modules: set[nn.Module], ignored_params: set[int]) -> list[nn.Parameter]:
    """The parameters this instance flattens: unique, not ignored, not flattened by a nested one."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for m in managed_modules(module, ignored_modules):
        for p in m._parameters.values():
            if p is None or id(p) in seen or id(p) in ignored_params or getattr(p, FLATTENED, False):
                continue
            seen.add(id(p))
            params.append(p)
    return params


def materialize(
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    ignored_modules: set[nn.Module],
) -> None:
    """Materialize meta-device states of the modules this unit manages (FSDP1's rules)."""
    modules = list(managed_modules(module, ignored_modules))
    on_meta = any(
        t.is_meta for m in modules for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None
    )
    if not on_meta:
        return
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(f"param_init_fn must be callable but got {type(param_init_fn).__name__}")
        for m in modules:
            param_init_fn(m)
        return
    with torch.no_grad():
        for m in modules:
            m.to_empty(device=device, recurse=False)
        for m in modules:
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def move_cpu_states(module: nn.Module, device: torch.device, ignored_modules: set[nn.Module]) -> None:
    """Move the parameters and buffers still on the CPU to ``device`` (``device_id``). States on
    another device stay, so the compute-device check can name them (torch FSDP1's rule)."""
    with torch.no_grad():
        for m in managed_modules(module, ignored_modules):
            for p in m._parameters.values():
                if p is not None and p.device.type == "cpu" and p.device != device:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and b.device.type == "cpu" and b.device != device:
                    m._buffers[name] = b.to(device)


def sync_states(tensors: list[Tensor], groups: list[dist.ProcessGroup]) -> None:
    """Every rank takes rank 0's values (rank 0 of each group in turn: shard, then replicate).

    CPU tensors travel through the group's accelerator where its backend refuses them
    ([Note: CPU tensors on accelerator groups]).
    """
    with torch.no_grad():
        for group in groups:
            src = dist.get_global_rank(group, 0)
            for t in tensors:
                sent = collectives.staged(t.detach(), group)
                dist.broadcast(sent, src=src, group=group)
                if sent is not t:
                    t.copy_(sent)
