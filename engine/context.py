"""State shared by every unit of one root: streams, the all-gather limiter, execution order.

The root creates one :class:`RootContext` at lazy initialization and hands the same object to
every unit in its tree; nothing in it is copied attribute by attribute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

import torch

from engine.precision import BufferPrecision

#: a unit; the context only orders and lists them (the units import the context, not the reverse).
U = TypeVar("U", bound=Hashable)

__all__ = ["AllGatherLimiter", "ExecOrder", "RootContext", "Streams"]


@dataclass
class Streams:
    """CUDA side streams (all None on CPU, where communication is synchronous)."""

    #: all-gathers (and the host-to-device copy of offloaded shards) run here.
    all_gather: torch.cuda.Stream | None = None
    #: gradient reduction, its casts and the device-to-host copy of offloaded gradients run here.
    post_backward: torch.cuda.Stream | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> "Streams":
        if device.type != "cuda":
            return cls()
        # High priority: communication should not queue behind compute kernels.
        return cls(
            all_gather=torch.cuda.Stream(device=device, priority=-1),
            post_backward=torch.cuda.Stream(device=device, priority=-1),
        )

    def gather_after_compute(self) -> None:
        """Order later all-gathers after everything issued on the current stream so far (the
        optimizer step, adopted user writes): all-gathers read shards without waiting per call
        ([Note: stream ordering] in :mod:`engine.collectives`)."""
        if self.all_gather is not None:
            self.all_gather.wait_stream(torch.cuda.current_stream(self.all_gather.device))


class AllGatherLimiter:
    """At most ``max_in_flight`` unsharded buffers between an all-gather and its free.

    [Note: rate-limited all-gathers] Without a limit the CPU thread can run far ahead of the GPU
    and issue every unit's all-gather before the first is freed, so peak memory becomes the whole
    model. Each free records an event on the compute stream; before issuing an all-gather, if
    ``max_in_flight`` frees are pending, the CPU waits for the oldest one, one per all-gather (torch
    FSDP1's rule). Waiting until fewer than ``max_in_flight`` were pending would, after a
    SHARD_GRAD_OP backward (a free per unit, none in forward), make the next forward's first
    all-gather wait for nearly every free of that backward: the CPU could not run ahead of the GPU
    into the next step.
    """

    def __init__(self, enabled: bool, max_in_flight: int = 2) -> None:
        self.enabled = enabled
        self.max_in_flight = max_in_flight
        self._free_events: deque[torch.cuda.Event] = deque()

    def record_free(self, device: torch.device) -> None:
        if not self.enabled or device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._free_events.append(event)

    def wait_if_needed(self) -> None:
        if self.enabled and len(self._free_events) >= self.max_in_flight:
            self._free_events.popleft().synchronize()

    def __len__(self) -> int:
        return len(self._free_events)


@dataclass
class ExecOrder(Generic[U]):
    """Order in which units ran their pre- and post-forward in the first iteration.

    Backward runs roughly in reverse post-forward order, so the unit before ``u`` in
    ``post_forward`` is the one to prefetch during ``u``'s backward; the unit after ``u`` in
    ``pre_forward`` is the one to prefetch during ``u``'s forward. Frozen after the first
    iteration: later orders are only compared against it.
    """

    pre_forward: list[U] = field(default_factory=list)
    post_forward: list[U] = field(default_factory=list)
    frozen: bool = False

    def record_pre_forward(self, unit: U) -> None:
        if not self.frozen and unit not in self.pre_forward:
            self.pre_forward.append(unit)

    def record_post_forward(self, unit: U) -> None:
        if not self.frozen and unit not in self.post_forward:
            self.post_forward.append(unit)

    def next_forward(self, unit: U) -> "U | None":
        if not self.frozen or unit not in self.pre_forward:
            return None
        i = self.pre_forward.index(unit)
        return self.pre_forward[i + 1] if i + 1 < len(self.pre_forward) else None

    def next_backward(self, unit: U) -> "U | None":
        if unit not in self.post_forward:
            return None
        i = self.post_forward.index(unit)
        return self.post_forward[i - 1] if i > 0 else None


@dataclass
class RootContext(Generic[U]):
    """Everything the units of one root share."""

    #: compute device of the root (every unit computes on it).
    device: torch.device
    streams: Streams
    limiter: AllGatherLimiter
    #: every unit with parameters in the root's tree, in module order.
    units: list[U]
    #: the root's final callback, queued by the first pre-backward hook of a backward.
    finish_backward: Callable[[], None]
    exec_order: ExecOrder[U] = field(default_factory=ExecOrder)
    #: set when the first pre-backward hook of a backward queues the final callback.
    final_callback_queued: bool = False
    #: number of root forwards so far (the exec order freezes at the second).
    forward_count: int = 0
    #: the floating-point buffers of the tree with their original and compute dtypes.
    buffers: BufferPrecision | None = None
    #: units whose original parameters this forward has not yet written back: each is written back just
    #: before its first all-gather of the forward, so the root's all-gather need not wait for every unit's.
    writeback_pending: set[U] = field(default_factory=set)
