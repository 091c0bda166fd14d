"""Peak memory on CPU ranks, which have no caching allocator to ask (``torch.cuda.max_memory_allocated`` is the
GPU's answer): the bytes of the live tensor storages, summed after every operator, and what was alive at the
peak.

Every storage alive when tracking starts counts (parameters, optimizer states), and so does each one an operator
makes while tracking. A storage counts at its current size, so one an engine frees by resizing it to zero (FSDP's
unsharded parameters) stops counting then, as it does on a GPU. Each allocation made while tracking is labelled
with the step's phase, the operator and the innermost frame outside torch's core (an engine's or the harness's
code, or torch.distributed's), so two engines' peaks can be told apart by what they hold, not only by how much.
Summing after every operator is slow: this runs for a few steps after the timed ones (``harness perf
--profile``), never inside them.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["BEFORE", "LiveStorages", "largest", "memory_lines"]

#: the label of the storages alive when tracking started (one resized since counts at its size at the peak).
BEFORE = "made before the steps"
_TORCH = os.path.dirname(torch.__file__) + os.sep
_DISTRIBUTED = os.path.join(_TORCH, "distributed") + os.sep


def _caller() -> str:
    """The innermost frame outside torch's core and outside this module, as ``dir/file.py:line function``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and (not name.startswith(_TORCH) or name.startswith(_DISTRIBUTED)):
            short = os.sep.join(name.split(os.sep)[-2:])
            return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


class LiveStorages(TorchDispatchMode):
    """Inside ``with LiveStorages() as live:``, ``live.peak_bytes`` is the most the tracked storages held at once,
    ``live.peak_phase`` the ``phase`` set then and ``live.at_peak`` the ``(bytes, label)`` of each one alive then."""

    def __init__(self) -> None:
        super().__init__()
        #: set by the caller as the step goes (forward, backward, optimizer); part of each new label.
        self.phase = ""
        self._live: dict[int, tuple[weakref.ref[Any], str]] = {}
        self.peak_bytes = 0
        self.peak_phase = ""
        self.at_peak: list[tuple[int, str]] = []
        self.before_bytes = 0

    def __enter__(self) -> LiveStorages:
        with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for tensor in tensors:
            kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "tensor"
            self._add(tensor, f"{BEFORE}: {kind} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")
        self._update()
        #: the bytes alive when tracking started.
        self.before_bytes = self.peak_bytes
        return super().__enter__()

    def _add(self, tensor: torch.Tensor, label: str) -> None:
        local = getattr(tensor, "_local_tensor", None)  # a DTensor's bytes are its shard's
        if local is not None:
            tensor = local
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass without storage of its own
            return
        known = self._live.get(id(storage))
        # A storage freed during the operator leaves its id to a new one: the stale entry gives way.
        if known is None or known[0]() is not storage:
            self._live[id(storage)] = (weakref.ref(storage), label)

    def _update(self) -> None:
        alive: list[tuple[int, str]] = []
        for key, (ref, label) in list(self._live.items()):
            storage = ref()
            if storage is None:
                del self._live[key]
            else:
                alive.append((storage.nbytes(), label))
        total = sum(size for size, _ in alive)
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_phase, self.at_peak = total, self.phase, alive

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        label = f"{self.phase}: {func.__name__} ({_caller()})"
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._add(value, label)
        self._update()
        return out


def largest(at_peak: list[tuple[int, str]], n: int = 8) -> list[tuple[str, int, int]]:
    """The ``n`` labels holding the most bytes at the peak: ``(label, bytes, storages)``, largest first."""
    size: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for nbytes, label in at_peak:
        if nbytes:
            size[label] += nbytes
            count[label] += 1
    return [(label, nbytes, count[label]) for label, nbytes in size.most_common(n)]


def memory_lines(name: str, report: dict[str, Any]) -> list[str]:
    """A rank's peak as ``harness perf --profile`` prints it, from what ``perf_job`` wrote (``peak_bytes``,
    ``peak_phase``, ``before_bytes``, ``largest``)."""
    mib = 2 ** 20
    lines = [f"{name}: peak of live tensors {report['peak_bytes'] / mib:.2f} MiB in {report['peak_phase'] or 'the step'}"
             f" ({report['before_bytes'] / mib:.2f} MiB alive before the steps); largest then:"]
    lines += [f"  {nbytes / mib:9.2f} MiB x{count:<4d} {label}" for label, nbytes, count in report["largest"]]
    return lines
