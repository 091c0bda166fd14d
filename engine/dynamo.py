"""Keeping the engine's forward out of Dynamo's tracing, as torch FSDP1's is.

Under ``torch.compile`` torch FSDP1 keeps its collectives out of the compiled graphs, which break at
its units' boundaries while Dynamo compiles the wrapped modules between them (see torch's ``[note:
Dynamo treats FSDP wrapped modules as UnspecializedNNModule]``). This engine lives outside torch, so Dynamo
would trace its hooks and turn their ``torch.distributed`` calls into functional collectives.

``eager_frame`` marks a unit's ``forward``: its own frame (the hooks it calls) runs eagerly and the
wrapped module's frames are compiled, so a compiled caller breaks once per unit, not at every hook.
``outside_dynamo`` marks a hook that must stay eager with everything it calls, wherever it is called
from. Both call the function plainly while Dynamo is not loaded (importing it costs every rank process
seconds, and a process that never compiles never needs it), and through ``torch._disable_dynamo`` once
it is: that wrapper lives in a module on Dynamo's skip list, so Dynamo breaks the graph at the call
rather than tracing into it (or into its import of Dynamo).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager_frame", "outside_dynamo"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F, recursive: bool) -> _F:
    """``fn`` run plainly without Dynamo loaded, else as ``torch._disable_dynamo(fn, recursive)``."""
    disabled = torch._disable_dynamo(fn, recursive=recursive)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing compiles without Dynamo loaded
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    return run  # type: ignore[return-value]


def outside_dynamo(fn: _F) -> _F:
    """``fn`` runs eagerly, with the frames it calls, even inside a compiled model."""
    return _eager(fn, recursive=True)


def eager_frame(fn: _F) -> _F:
    """``fn``'s own frame runs eagerly inside a compiled model; the frames it calls are compiled."""
    return _eager(fn, recursive=False)
