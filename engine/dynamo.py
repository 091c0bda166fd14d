"""Keeping the engine's forward out of Dynamo's tracing, as torch FSDP1's is.

torch FSDP1 runs its hooks eagerly under ``torch.compile`` and lets Dynamo compile the wrapped modules
between them, so a compiled model breaks its graph at unit boundaries (see torch's ``[note: Dynamo
treats FSDP wrapped modules as UnspecializedNNModule]``). This engine lives outside torch, so Dynamo
would trace its hooks and turn their ``torch.distributed`` calls into functional collectives.

``eager_frame`` marks a unit's ``forward``: its own frame (the hooks it calls) runs eagerly and the
wrapped module's frames are compiled, so a compiled caller breaks once per unit, not at every hook.
``outside_dynamo`` marks a hook that must stay eager with everything it calls, wherever it is called
from. Both go through ``torch._disable_dynamo``, which imports Dynamo on a marked function's first call
only: importing it costs every rank process seconds, and a process that never compiles never needs it.
Dynamo skips the wrapper's frame (``torch._compile`` is on its skip list), so the first call of a
compiled model does not trace the import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager_frame", "outside_dynamo"]

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_dynamo(fn: _F) -> _F:
    """``fn`` runs eagerly, with the frames it calls, even inside a compiled model."""
    return torch._disable_dynamo(fn, recursive=True)


def eager_frame(fn: _F) -> _F:
    """``fn``'s own frame runs eagerly inside a compiled model; the frames it calls are compiled."""
    return torch._disable_dynamo(fn, recursive=False)
