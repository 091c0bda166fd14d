"""Mixed precision outside the flat parameter: forward inputs, buffers, full precision in eval.

The flat-parameter handle owns the parameter side (the all-gather dtype, the reduce dtype, the
compute leaf); this module owns what FSDP1 casts around it:

- forward inputs: floating-point tensors cast to ``param_dtype`` (integer tensors never are, so
  embedding indices survive) by :func:`cast_floating_tensors`;
- buffers: :class:`BufferPrecision`, one per root, casts every floating-point buffer its units
  manage to the ``buffer_dtype`` of the *innermost* unit that manages it (a unit's own setting
  wins for its submodules) at the root's lazy initialization, and back to the original dtype for
  full precision in eval; state dicts save buffers in the original dtype (a state-dict hook in
  :mod:`engine.fully_sharded`). Buffers of ignored modules are never touched;
- ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (:func:`full_prec_in_eval_from_env`): units not in training
  mode compute, communicate and keep buffers in full precision.

[Note: full precision in eval]
FSDP1 decides per unit, from the wrapped module's ``training`` flag, whether to ignore mixed
precision (``_force_full_precision``). We decide once per iteration, at the root's pre-forward,
when every unit is resharded, and keep the decision until the next root forward: forward and the
backward that follows it use the same dtypes even if ``train()`` is called in between, and a
prefetch issued during the iteration gathers in the dtype its unit will compute in.
"""

from __future__ import annotations

import os
from enum import Enum, auto
from typing import Any, Iterable, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

__all__ = [
    "FULL_PREC_IN_EVAL_ENV",
    "BufferPrecision",
    "BufferState",
    "cast_floating_tensors",
    "full_prec_in_eval_from_env",
]

#: FSDP1's environment variable: ``1`` runs modules in eval mode in full precision.
FULL_PREC_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"


def full_prec_in_eval_from_env() -> bool:
    """Whether ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read at construction, as FSDP1 does)."""
    return os.environ.get(FULL_PREC_IN_EVAL_ENV, "") == "1"


def cast_floating_tensors(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (differentiably).

    Integer and boolean tensors are left alone: casting token ids would break embedding tables.
    ``dtype=None`` returns ``tree`` unchanged.
    """
    if dtype is None:
        return tree

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return tree_map_only(Tensor, cast, tree)


class BufferState(Enum):
    #: every buffer has the dtype it had when the root was initialized.
    ORIGINAL = auto()
    #: every buffer has the ``buffer_dtype`` of its unit (or its original dtype where that is None).
    COMPUTE = auto()


class _Buffer(NamedTuple):
    """One managed buffer; its ``.data`` is swapped to change dtype, so references stay valid."""

    tensor: Tensor
    original: torch.dtype
    #: the owning unit's ``buffer_dtype``; None keeps the original dtype.
    compute: torch.dtype | None


class BufferPrecision:
    """The floating-point buffers of one root's units with their original and compute dtypes.

    Created at the root's lazy initialization from ``(module, buffer_dtype)`` pairs, innermost
    unit first; buffers of ignored modules are never passed in and keep their dtype. The dtype
    changes only through :meth:`to_compute` and :meth:`to_original`.
    """

    def __init__(self, owned: Iterable[tuple[Iterable[Tensor], torch.dtype | None]], device: torch.device) -> None:
        self.device = device
        seen: set[int] = set()
        buffers: list[_Buffer] = []
        for tensors, compute in owned:
            for t in tensors:
                # A buffer registered under two names (or in two units) belongs to the first,
                # innermost, owner.
                if id(t) in seen:
                    continue
                seen.add(id(t))
                buffers.append(_Buffer(t, t.dtype, compute if t.is_floating_point() else None))
        self._buffers = tuple(buffers)
        self._original_by_id = {id(b.tensor): b.original for b in buffers}
        self.state = BufferState.ORIGINAL

    def __len__(self) -> int:
        return len(self._buffers)

    @torch.no_grad()
    def to_compute(self) -> None:
        """Each buffer on the compute device in its unit's ``buffer_dtype``."""
        for b in self._buffers:
            self._set(b.tensor, b.compute or b.original)
        self.state = BufferState.COMPUTE

    @torch.no_grad()
    def to_original(self) -> None:
        """Each buffer on the compute device in the dtype it was created with."""
        for b in self._buffers:
            self._set(b.tensor, b.original)
        self.state = BufferState.ORIGINAL

    def _set(self, t: Tensor, dtype: torch.dtype) -> None:
        if t.dtype != dtype or t.device != self.device:
            t.data = t.data.to(device=self.device, dtype=dtype)

    def original_dtype(self, t: Tensor) -> torch.dtype | None:
        """The dtype ``t`` had at initialization, None if it is not a managed buffer."""
        return self._original_by_id.get(id(t))
