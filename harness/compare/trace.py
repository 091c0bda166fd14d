"""The communication trace: every collective an engine issues during a case, in call order.

``CommTrace`` wraps the ``torch.distributed`` collectives (in both the ``torch.distributed`` and the
``distributed_c10d`` namespaces, so ``dist.x`` and ``c10d.x`` callers are both seen) for the duration
of a ``with`` block and records, per call, the op kind, the elements and bytes of the *full* side
(the all-gather output, the reduce-scatter input, the all-reduced tensor), the dtype, the group's size and
global ranks (a 2-rank shard group and a 2-rank replica group differ only in their ranks), and the training phase and step the caller set. Forward-pre hooks on the model's leaf modules add
``compute`` markers, so the position of an all-gather relative to the compute it serves is visible
(that is what forward prefetch changes).

The knob checks read the trace: the all-gathers in backward tell FULL_SHARD from SHARD_GRAD_OP, the
dtype of a reduce-scatter is the reduce dtype the engine really used, and a prefetch setting must
change the order of the trace against the same case without it. Bytes all-gathered and
reduce-scattered per case are sums over the trace.

With ``keep_inputs=True`` each all-gather event also keeps its local shard (``TensorSeen``: dtype,
device, storage address and a weak reference to the storage), which conformance jobs use to check
that a low-precision shard copy was made when it must be and freed after its gather.

Only calls made through the module attributes are seen: an engine that bound a collective at import
time (``from torch.distributed import all_gather_into_tensor``) or calls the process group directly
is invisible here, and its knob checks say so by failing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["CommEvent", "CommTrace", "OpKind", "TRACED", "TensorSeen", "dtypes", "movable_gathers", "ops", "signature", "total_bytes"]

OpKind = Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast", "compute"]

#: The traced ``torch.distributed`` functions and what they do; names a torch version lacks are skipped
#: (2.11 calls ``all_gather_into_tensor``/``reduce_scatter_tensor``, 2.13 the ``*_single`` names).
TRACED: dict[str, OpKind] = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}

#: The argument holding the full side of each function (a tensor, or a list of tensors).
_FULL_SIDE: dict[str, str] = {
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather": "tensor_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter": "input_list",
    "all_reduce": "tensor",
    "broadcast": "tensor",
}

#: The argument holding the local side of each all-gather (the rank's shard).
_LOCAL_SIDE: dict[str, str] = {
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "_all_gather_base": "input_tensor",
    "all_gather": "tensor",
}

_NAMESPACES = (dist, dist.distributed_c10d)


@dataclass(frozen=True)
class TensorSeen:
    """A tensor a collective was called with, as it was at call time."""

    dtype: torch.dtype
    device: torch.device
    #: the storage's address at call time.
    storage_ptr: int
    #: the storage itself, weakly: recording must not keep freed memory alive. A storage's Python
    #: object lives as long as the storage does (torch preserves it), whichever tensor views it.
    storage: weakref.ref

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSeen":
        storage = t.untyped_storage()
        return cls(t.dtype, t.device, storage.data_ptr(), weakref.ref(storage))


@dataclass(frozen=True)
class CommEvent:
    """One traced collective call, or a ``compute`` marker (a leaf module's forward starting)."""

    op: OpKind
    #: the ``torch.distributed`` function called, or the leaf module's name for ``compute``.
    name: str
    #: elements of the full side (0 for ``compute``).
    numel: int
    nbytes: int
    #: dtype of the full side, e.g. ``"float32"`` (empty for ``compute``).
    dtype: str
    #: ranks in the group the call ran on (1 for ``compute``).
    group_size: int
    #: the phase the training loop had set: ``forward``, ``backward``, ``step`` or ``other``.
    phase: str
    step: int
    #: global ranks of the group the call ran on, in group order (empty for ``compute``, or where the
    #: group could not be read).
    group_ranks: tuple[int, ...] = ()
    #: the all-gather's local shard, kept only by a ``CommTrace(keep_inputs=True)``.
    local: TensorSeen | None = field(default=None, compare=False, repr=False)


def _full_side(name: str, bound: inspect.BoundArguments) -> tuple[int, int, str]:
    value = bound.arguments.get(_FULL_SIDE[name])
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0, 0, ""
    numel = sum(t.numel() for t in tensors)
    return numel, sum(t.numel() * t.element_size() for t in tensors), str(tensors[0].dtype).removeprefix("torch.")


def _group(group: Any) -> tuple[int, tuple[int, ...]]:
    """The group's size and global ranks (``-1`` and none for a group this rank is not in: the call
    itself will say what is wrong)."""
    try:
        group = group if group is not None else dist.group.WORLD
        return dist.get_world_size(group), tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return -1, ()


class CommTrace:
    """Records collectives while active; use as a context manager around an engine's training.

    The training loop sets ``phase`` and ``step``; ``paused()`` hides the harness's own bookkeeping
    collectives (gathering norms, unsharding for the final comparison). ``before_reduce`` runs
    before each reduce-scatter and all-reduce of the backward phase (the models' GPU sleeps);
    ``around(when, kind, phase)`` runs before (``when="before"``) and after (``"after"``) every recorded
    collective (``harness.compare.stress``).
    """

    def __init__(
        self,
        before_reduce: Callable[[], None] | None = None,
        around: Callable[[str, str, str], None] | None = None,
        *,
        keep_inputs: bool = False,
    ) -> None:
        self.events: list[CommEvent] = []
        #: record each all-gather's local shard (``CommEvent.local``).
        self.keep_inputs = keep_inputs
        self.phase = "other"
        self.step = 0
        self.before_reduce = before_reduce
        self.around = around
        #: False while paused: calls pass through unrecorded.
        self._recording = False
        #: (namespace, name, original) for every patched function, to restore on exit.
        self._patched: list[tuple[Any, str, Callable[..., Any]]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # A traced function calling another traced one (all_gather_into_tensor -> all_gather_single
        # in 2.13) must count once: only the outermost call is recorded.
        self._depth = threading.local()

    # -- lifecycle ----------------------------------------------------------------------------------

    def __enter__(self) -> "CommTrace":
        if self._patched:
            raise RuntimeError("CommTrace is already active; a trace cannot be entered twice")
        originals: dict[int, Callable[..., Any]] = {}
        for namespace in _NAMESPACES:
            for name in TRACED:
                original = getattr(namespace, name, None)
                if original is None:
                    continue
                # Both namespaces usually hold the same function object: wrap it once, install twice.
                wrapper = originals.setdefault(id(original), self._wrap(name, original))
                setattr(namespace, name, wrapper)
                self._patched.append((namespace, name, original))
        self._recording = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._recording = False
        for namespace, name, original in reversed(self._patched):
            setattr(namespace, name, original)
        self._patched.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        previous, self._recording = self._recording, False
        try:
            yield
        finally:
            self._recording = previous

    def watch_modules(self, model: nn.Module) -> None:
        """Add a ``compute`` marker whenever a leaf module with parameters starts its forward.

        Register on the unwrapped model: wrappers keep the same leaf module objects, so the markers
        name modules as the model does.
        """
        for name, module in model.named_modules():
            if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._mark, name)))

    def _mark(self, name: str, module: nn.Module, args: object) -> None:
        if self._recording:
            self.events.append(CommEvent("compute", name, 0, 0, "", 1, self.phase, self.step))

    # -- recording ----------------------------------------------------------------------------------

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind = TRACED[name]
        sig = inspect.signature(original)

        @functools.wraps(original)
        def traced(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            bound = None
            if depth == 0 and self._recording:
                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError:
                    pass  # a bad call: the original raises the error its caller should see
            if bound is not None:
                numel, nbytes, dtype = _full_side(name, bound)
                group = bound.arguments.get("group")
                local = bound.arguments.get(_LOCAL_SIDE.get(name, ""))
                seen = TensorSeen.of(local) if self.keep_inputs and isinstance(local, torch.Tensor) else None
                size, ranks = _group(group)
                self.events.append(CommEvent(kind, name, numel, nbytes, dtype, size, self.phase, self.step, ranks, seen))
                if self.before_reduce is not None and self.phase == "backward" and kind in ("reduce_scatter", "all_reduce"):
                    self.before_reduce()
                if self.around is not None:
                    self.around("before", kind, self.phase)
            self._depth.value = depth + 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth.value = depth
            if bound is not None and self.around is not None:
                self.around("after", kind, self.phase)
            return result

        return traced


def wrapper_code() -> types.CodeType:
    """The code every collective wrapper of ``CommTrace`` runs (one function body, a closure per collective).

    ``harness.compare.compiling`` marks it for Dynamo's frame evaluation to skip, so that the wrapper changes
    nothing under ``torch.compile``: called from an engine's eager hook (torch FSDP1's and FSDP2's run
    eagerly), the original collective is a frame of torch's, which Dynamo never compiles, and the wrapper
    must not be one Dynamo compiles on its own (it would turn the collective into a functional one,
    recorded once at tracing and crashing on gloo ranks with CUDA tensors); called from hooks Dynamo
    traces, it is inlined as the original call would be.
    """
    return next(c for c in CommTrace._wrap.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "traced")


# ---------------------------------------------------------------------------------------------------
# Queries (pure functions over events)


def ops(
    events: Sequence[CommEvent],
    *,
    op: OpKind | Sequence[OpKind] | None = None,
    phase: str | None = None,
    min_group: int = 2,
    steps: range | None = None,
) -> list[CommEvent]:
    """Collectives (never markers unless asked by ``op``) filtered by kind, phase, group size and step.

    ``min_group=2`` drops one-rank groups (a rank-local expert's "reduction" moves nothing).
    """
    kinds = (op,) if isinstance(op, str) else tuple(op) if op is not None else None
    out = []
    for e in events:
        if kinds is None and e.op == "compute":
            continue
        if kinds is not None and e.op not in kinds:
            continue
        if e.op != "compute" and e.group_size < min_group:
            continue
        if phase is not None and e.phase != phase:
            continue
        if steps is not None and e.step not in steps:
            continue
        out.append(e)
    return out


def signature(events: Sequence[CommEvent], *, phase: str, steps: range) -> tuple[tuple[Any, ...], ...]:
    """The order of one phase: collectives as (step, kind, numel, group size), markers as
    (step, compute, module). One-rank groups count here: issuing a prefetch before a rank-local
    unit's reduction is a change of order too."""
    sig: list[tuple[Any, ...]] = []
    for e in events:
        if e.phase != phase or e.step not in steps:
            continue
        if e.op == "compute":
            sig.append((e.step, "compute", e.name))
        else:
            sig.append((e.step, e.op, e.numel, e.group_size))
    return tuple(sig)


def movable_gathers(sig: Sequence[tuple[Any, ...]]) -> int:
    """All-gathers of a signature that something else of their step precedes: the ones a prefetch
    could move earlier. With none, no setting can change the order."""
    seen_steps: set[Any] = set()
    movable = 0
    for item in sig:
        if item[1] == "all_gather" and item[0] in seen_steps:
            movable += 1
        seen_steps.add(item[0])
    return movable


def dtypes(events: Sequence[CommEvent]) -> set[str]:
    """The dtypes the collectives among ``events`` carried (markers have none)."""
    return {e.dtype for e in events if e.op != "compute"}


def total_bytes(events: Sequence[CommEvent], op: OpKind) -> int:
    """Bytes of the full side of every ``op`` over groups of two or more ranks."""
    return sum(e.nbytes for e in ops(events, op=op))
