"""Stress mode: delays on the CUDA compute stream where a missing stream wait would show.

An engine that forgets one ``wait_stream`` (a reduce-scatter on a side stream reading a gradient the
compute stream is still writing, a CPU copy read before it landed, a parameter freed while a kernel
still reads it) passes whenever the GPU happens to be idle: the racing kernel has already finished.
``Stress`` enqueues a GPU sleep (``harness.cases.models.gpu_sleep``) at each such point, so the writer is
late every time and the race shows on every run instead of when other jobs load the GPU.

[Note: where the delays go]
All of them are installed by the harness on the model, the optimizer and ``torch.distributed``
(through ``harness.compare.trace.CommTrace``), never inside an engine, so every engine meets the same delays:

- ``before_forward`` / ``before_free``: a forward pre and post hook on every wrap unit; the post hook
  runs inside the engine's unit, before it frees (reshards) the unsharded parameters;
- ``before_backward``: a hook on each unit's output gradient, before the unit's backward kernels;
- ``before_reduce``: before each reduce-scatter and all-reduce of the backward pass (on whatever
  stream the engine issues it from), and ``after_grad``: a post-accumulate-grad hook on every
  parameter the engine trains (where it can hold one);
- ``before_offload_copy``: right after each backward reduction, on the reducing stream: where an
  engine with CPU offload copies the reduced gradient to the host;
- ``before_step``: an optimizer step pre-hook (a CPU-offloaded step reads host gradients);
- ``around_summon``: before and after the harness unshards the parameters for the final comparison;
  ``around_no_sync``: on entering and leaving the wrapped module's ``no_sync()`` (the instance's
  method is wrapped, for a training loop that accumulates gradients; the parity loop does not).

On CPU every op is synchronous and there is nothing to race: a stressed case is ``unsupported`` there
(``unsupported_reason``). The delays never change a value, so a stressed case that fails shows a race.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from harness.cases.models import ZooModel, gpu_sleep

__all__ = ["STRESS_MS", "Stress", "unsupported_reason"]

#: milliseconds per delay: far above the microseconds the zoo's kernels take and the host time between
#: an unsynchronized enqueue and its reader, short enough that a stressed matrix run stays cheap.
STRESS_MS = 20.0


def unsupported_reason(stress: str, device_type: str) -> str | None:
    """Why a case with ``stress`` cannot run on a ``device_type`` rank (None: it can)."""
    if stress == "none" or device_type == "cuda":
        return None
    return (f"stress={stress!r} delays the CUDA compute stream to expose stream races; this rank runs on "
            f"{device_type}, where every op is synchronous and there is no stream to race (run on GPUs, or "
            "without --stress)")


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


class _Restore:
    """Undoes an instance attribute set over a method (a handle like the hooks')."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


class Stress:
    """The delays of one engine run; ``counts`` says how often each point fired (the record keeps it).

    ``sleep(ms, device)`` is ``gpu_sleep`` by default; tests pass a recorder to see the points fire on CPU.
    """

    def __init__(self, device: torch.device, ms: float = STRESS_MS,
                 sleep: Callable[[float, torch.device], None] = gpu_sleep) -> None:
        self.device = device
        self.ms = ms
        self.counts: collections.Counter[str] = collections.Counter()
        self._sleep = sleep
        self._handles: list[Any] = []

    def delay(self, point: str) -> None:
        self.counts[point] += 1
        self._sleep(self.ms, self.device)

    # -- installation (see [Note: where the delays go]) ------------------------------------------------

    def watch_model(self, model: ZooModel) -> None:
        """Forward, free and backward points on every wrap unit and the root; call before wrapping."""
        for unit in [*model.wrap_units(), model]:
            self._handles.append(unit.register_forward_pre_hook(lambda m, args: self.delay("before_forward")))
            self._handles.append(unit.register_forward_hook(self._after_forward))

    def _after_forward(self, module: nn.Module, args: object, output: Any) -> None:
        self.delay("before_free")
        tensor = _first_tensor(output)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(self._before_backward)

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.delay("before_backward")

    def watch_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """``after_grad`` on every leaf parameter that takes a post-accumulate-grad hook."""
        for p in params:
            if not p.requires_grad or not p.is_leaf:
                continue
            try:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda t: self.delay("after_grad")))
            except RuntimeError:
                continue  # a tensor subclass or view that refuses the hook: the other points still fire

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.delay("before_step")))

    def on_collective(self, when: str, kind: str, phase: str) -> None:
        """``harness.compare.trace.CommTrace``'s callback around each recorded collective."""
        if phase != "backward" or kind not in ("reduce_scatter", "all_reduce"):
            return
        self.delay("before_reduce" if when == "before" else "before_offload_copy")

    def watch_no_sync(self, module: nn.Module) -> None:
        """``around_no_sync`` on ``module.no_sync()`` where the module has one."""
        original = getattr(module, "no_sync", None)
        if original is None or not callable(original):
            return

        @contextlib.contextmanager
        def no_sync(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with self.around("around_no_sync"), original(*args, **kwargs) as value:
                yield value

        module.no_sync = no_sync  # type: ignore[method-assign]
        self._handles.append(_Restore(module, "no_sync"))

    @contextlib.contextmanager
    def around(self, point: str) -> Iterator[None]:
        self.delay(point)
        try:
            yield
        finally:
            self.delay(point)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
