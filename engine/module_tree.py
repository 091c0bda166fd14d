"""Walking a module tree as FSDP sees it: which modules are FSDP instances, which modules and
buffers an instance manages (not entering nested instances or ignored modules).

Recognises instances by a class attribute, so nothing here (or below) imports the public wrapper.
"""

from __future__ import annotations

from typing import Iterator

import torch.nn as nn
from torch import Tensor

__all__ = ["is_fsdp", "managed_buffers", "managed_modules"]

#: the class attribute that marks FSDP instances (set by the public wrapper).
FSDP_MARKER = "_is_fsdp_unit"


def is_fsdp(module: nn.Module) -> bool:
    return getattr(type(module), FSDP_MARKER, False)


def managed_modules(module: nn.Module, ignored: set[nn.Module]) -> Iterator[nn.Module]:
    """``module`` and its descendants, not entering nested instances or ignored modules."""
    stack = [module]
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        for child in reversed(list(m.children())):
            if not is_fsdp(child) and child not in ignored:
                stack.append(child)


def managed_buffers(module: nn.Module, ignored: set[nn.Module]) -> list[Tensor]:
    """The buffers registered on the modules ``module`` manages."""
    return [b for m in managed_modules(module, ignored) for b in m._buffers.values() if b is not None]
