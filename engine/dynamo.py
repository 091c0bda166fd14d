"""Keeping the engine's hooks out of Dynamo's tracing, as torch FSDP1's are.

Dynamo never traces torch FSDP1's runtime: everything under ``torch.distributed.fsdp`` is on its skip
list, so the hooks run eagerly and a compiled model breaks its graph at each unit's boundary (see
torch's ``[note: Dynamo treats FSDP wrapped modules as UnspecializedNNModule]``). This engine lives
outside torch, so Dynamo would trace its hooks and turn their ``torch.distributed`` calls into
functional collectives. ``outside_dynamo`` marks a hook to run eagerly under ``torch.compile``, with
``torch._dynamo.disable`` applied on first use only once Dynamo is loaded: importing Dynamo costs every
rank process seconds, and a process that never compiles never needs it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["outside_dynamo"]

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_dynamo(fn: _F) -> _F:
    """``fn`` runs eagerly, with the frames it calls, even inside a compiled model."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # nothing compiles without Dynamo loaded
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(dynamo.disable(fn, reason="fsdp-parity engine hook: runs eagerly as torch FSDP1's"))
        return disabled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
