"""Where each original parameter lives in a flat parameter, as plain data.

Everything here is pure arithmetic over shapes and numels: no tensors, no process group. The
handle (``engine.flat_param``) builds one :class:`FlatLayout` at construction and asks it for
every offset it needs, so the layout can be checked exhaustively without processes.

[Note: layout identical to torch FSDP1]
Checkpoints and shard metadata must be interchangeable with torch FSDP1's, so the layout follows
its rules exactly:
- Parameters appear in module registration order; a shared parameter appears once, at its first
  occurrence.
- Aligned mode (``use_orig_params=True``): before each parameter, padding so that its start offset
  is a multiple of ``16 bytes / itemsize`` of the communication dtype; after the last parameter,
  padding to a multiple of the world size. Each rank's shard is the contiguous equal slice.
- Unaligned mode (``use_orig_params=False``): no padding in the unsharded buffer. Shards follow
  ``torch.chunk``: chunk size ``ceil(total / world_size)``, the last chunks may be short or empty
  and each is right-padded to the chunk size (a rank may hold only padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Sequence

#: alignment the compiler (TorchInductor) assumes for every original parameter's start address.
ALIGNMENT_BYTES = 16


class ParamEntry(NamedTuple):
    """One original parameter as seen by the layout: its name and geometry."""

    fqn: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: ``contiguous`` in the strict sense (last stride 1 and ``is_contiguous()``): decides whether
    #: its flat view is a ``view`` or an ``as_strided``.
    contiguous: bool
    numel: int


class ShardParamInfo(NamedTuple):
    """How much of one original parameter a shard holds (field names as torch FSDP1's)."""

    in_shard: bool
    #: index into the local shard where this parameter's part starts.
    offset_in_shard: int | None
    numel_in_shard: int | None
    #: inclusive range of the parameter's own flattened elements held by the shard.
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None


_NOT_IN_SHARD = ShardParamInfo(False, None, None, None, None)


def aligned_numel(itemsize: int) -> int:
    """Number of elements of ``itemsize`` bytes that make one alignment unit (at least 1)."""
    if itemsize <= 0:
        raise ValueError(f"itemsize={itemsize} must be positive")
    return max(ALIGNMENT_BYTES // itemsize, 1)


def chunk_size(total: int, world_size: int) -> int:
    """Elements per rank, padding included: ``torch.chunk``'s chunk size."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    return math.ceil(total / world_size)


@dataclass(frozen=True)
class FlatLayout:
    """The unsharded flat buffer of one handle: segments (parameters and padding) in order."""

    params: tuple[ParamEntry, ...]
    #: numel of every segment, padding segments included, in buffer order.
    numels_with_padding: tuple[int, ...]
    #: True where the segment of the same index is padding.
    is_padding_mask: tuple[bool, ...]
    world_size: int
    #: 0 in unaligned mode.
    aligned_numel: int

    # Cached (the layout is frozen): the runtime reads these for every unit at every unshard.
    @cached_property
    def total_numel(self) -> int:
        """Numel of the unsharded flat parameter (alignment and world-size padding included)."""
        return sum(self.numels_with_padding)

    @cached_property
    def param_segment_indices(self) -> tuple[int, ...]:
        """Index in :attr:`numels_with_padding` of every original parameter's segment, in order."""
        return tuple(i for i, pad in enumerate(self.is_padding_mask) if not pad)

    @property
    def shard_numel(self) -> int:
        """Numel of every rank's shard, right padding included."""
        return chunk_size(self.total_numel, self.world_size)

    @property
    def padded_unsharded_numel(self) -> int:
        """Numel of the all-gather output: ``world_size`` equal shards."""
        return self.shard_numel * self.world_size

    def segment_offsets(self) -> list[tuple[int, int]]:
        """Inclusive ``(start, end)`` of every segment in the unsharded buffer, padding included."""
        offsets, start = [], 0
        for numel in self.numels_with_padding:
            offsets.append((start, start + numel - 1))
            start += numel
        return offsets

    def param_offsets(self) -> list[int]:
        """Start of every original parameter in the unsharded buffer."""
        return [
            start
            for (start, _), pad in zip(self.segment_offsets(), self.is_padding_mask)
            if not pad
        ]

    def shard_bounds(self, rank: int) -> tuple[int, int, int]:
        """``(start, end_inclusive, numel_padded)`` of ``rank``'s shard in the unsharded buffer.

        ``end`` may lie past ``total_numel``: that tail of the shard is right padding, and
        ``numel_padded`` counts it.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        size = self.shard_numel
        start = rank * size
        real = max(0, min(size, self.total_numel - start))
        return start, start + size - 1, size - real

    def shard_param_infos(self, start: int, end: int) -> tuple[ShardParamInfo, ...]:
        """What the shard covering unsharded elements ``[start, end]`` (inclusive) holds of each
        original parameter; padding segments are skipped, not reported."""
        if start < 0 or end < start:
            raise ValueError(f"shard bounds start={start}, end={end} must satisfy 0 <= start <= end")
        infos: list[ShardParamInfo] = []
        for (seg_start, seg_end), pad in zip(self.segment_offsets(), self.is_padding_mask):
            if pad:
                continue
            # A zero-numel parameter counts as held only when strictly inside the shard, as in FSDP1.
            if seg_end < start or seg_start > end:
                infos.append(_NOT_IN_SHARD)
                continue
            intra_start = max(start, seg_start) - seg_start
            intra_end = min(end, seg_end) - seg_start
            infos.append(
                ShardParamInfo(
                    True,
                    max(seg_start - start, 0),
                    intra_end - intra_start + 1,
                    intra_start,
                    intra_end,
                )
            )
        return tuple(infos)


def build_layout(params: Sequence[ParamEntry], world_size: int, align_numel: int) -> FlatLayout:
    """Lay ``params`` (already deduplicated, in order) into one flat buffer.

    ``align_numel`` is 0 for the unaligned mode, else :func:`aligned_numel` of the communication
    dtype; aligned mode also pads the total to a multiple of ``world_size``.
    """
    if not params:
        raise ValueError("Cannot build a flat-parameter layout with an empty parameter list")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if align_numel < 0:
        raise ValueError(f"align_numel={align_numel} must be non-negative")
    numels: list[int] = []
    padding: list[bool] = []
    total = 0

    def pad_to(multiple: int) -> None:
        nonlocal total
        gap = -total % multiple
        if gap:
            numels.append(gap)
            padding.append(True)
            total += gap

    for entry in params:
        if align_numel > 0:
            pad_to(align_numel)
        numels.append(entry.numel)
        padding.append(False)
        total += entry.numel
    if align_numel > 0:
        pad_to(world_size)
    return FlatLayout(
        params=tuple(params),
        numels_with_padding=tuple(numels),
        is_padding_mask=tuple(padding),
        world_size=world_size,
        aligned_numel=align_numel,
    )
