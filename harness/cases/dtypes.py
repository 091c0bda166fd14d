"""The one dtype-name helper: case configs speak dtype names (``"bfloat16"``), the ranks need dtypes."""

from __future__ import annotations

import torch

__all__ = ["dtype_of"]


def dtype_of(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16``; None stays None."""
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype name {name!r} is not a torch dtype")
    return dtype
