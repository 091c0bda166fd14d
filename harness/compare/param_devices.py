"""Where a model's parameters and gradients live at each point of a training step.

Engine-neutral: it reads any ``nn.Module`` (an FSDP1-API engine, a reference) through
``named_parameters()``, module attributes and the hooks of ``torch.nn`` and ``torch.autograd``
only, so the same record serves a side-by-side comparison of two engines and a knob check of one
(:func:`offload_violations`: what ``CPUOffload(offload_params=True)`` promises).

A :data:`PlacementLog` maps ``point -> {parameter name -> (parameter device, gradient device or
None)}``. Two kinds of point:

- outside forward and backward (:data:`PARAMETER_POINTS`): ``model.named_parameters()``, what an
  optimizer and a user see, names with wrapper segments removed;
- inside forward and backward (:data:`COMPUTE_POINTS`): what the modules compute with, the
  attribute each original parameter was registered under (``module.weight``), read on the module
  that owns it when that module has run its forward (``forward``) and when its backward op has run
  (``backward``: after the gradient of its output arrived, before its parameters' gradients are
  accumulated). Names are the original parameter names, tied parameters under each name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_leaves

from harness.engines.adapters import canonical_name

__all__ = [
    "COMPUTE_POINTS",
    "PARAMETER_POINTS",
    "Placement",
    "PlacementLog",
    "Violation",
    "observe_compute",
    "observe_parameters",
    "offload_violations",
    "original_names",
    "record_training_step",
]

#: ``name -> (parameter device, gradient device or None)``; devices as ``str(torch.device)``.
Placement = dict[str, tuple[str, str | None]]
PlacementLog = dict[str, Placement]

#: points read from ``named_parameters()``, in the order :func:`record_training_step` reaches them.
PARAMETER_POINTS = (
    "after_construction",
    "after_forward",
    "after_backward",
    "after_step",
    "in_summon",
    "after_summon",
    "in_summon_offload_to_cpu",
    "after_summon_offload_to_cpu",
    "in_no_sync",
    "after_no_sync",
)
#: points read from the modules' parameter attributes during forward and backward.
COMPUTE_POINTS = ("forward", "backward")


def _device(t: Tensor | None) -> str | None:
    return None if t is None else str(t.device)


def observe_parameters(model: nn.Module) -> Placement:
    """Every parameter ``model.named_parameters()`` yields, with its gradient's device."""
    # Between forward and backward an engine may expose compute views, which are not leaves and
    # carry no ``.grad``.
    return {
        canonical_name(name): (str(p.device), _device(p.grad if p.is_leaf else None))
        for name, p in model.named_parameters()
    }


def original_names(model: nn.Module) -> list[str]:
    """Every registration of every parameter of an unwrapped ``model`` (tied ones under each name)."""
    return [canonical_name(name) for name, _ in model.named_parameters(remove_duplicate=False)]


def _resolver(model: nn.Module, names: Iterable[str]) -> dict[str, tuple[nn.Module, str]]:
    """``name -> (owning module, attribute)`` on ``model`` (wrapper segments removed)."""
    # A wrapper and the module it wraps share a path without wrapper segments; the later, inner
    # module is the owner.
    by_path = {canonical_name(path): m for path, m in model.named_modules(remove_duplicate=False)}
    out: dict[str, tuple[nn.Module, str]] = {}
    for name in names:
        path, _, attr = name.rpartition(".")
        module = by_path.get(path)
        if module is None:
            raise ValueError(f"parameter {name!r}: no module {path!r} in {type(model).__name__} (wrapper segments removed)")
        out[name] = (module, attr)
    return out


def _read(owners: dict[str, tuple[nn.Module, str]], names: Iterable[str]) -> Placement:
    out: Placement = {}
    for name in names:
        module, attr = owners[name]
        t = getattr(module, attr)
        # Only a leaf Parameter carries ``.grad``; compute views are not leaves.
        grad = t.grad if isinstance(t, nn.Parameter) else None
        out[name] = (str(t.device), _device(grad))
    return out


@contextlib.contextmanager
def observe_compute(model: nn.Module, names: Iterable[str], log: PlacementLog) -> Iterator[None]:
    """Within the context, record into ``log["forward"]`` each parameter attribute when the first
    module containing it finishes its forward, and into ``log["backward"]`` when that module's
    backward op has run.

    A parameter is read by the innermost module around it that runs a forward: its owner
    usually, an enclosing module where the owner's forward is never called (attention reads its
    output projection's weight directly).
    """
    owners = _resolver(model, list(names))
    handles = []
    for path, module in model.named_modules():
        prefix = canonical_name(path)
        inside = [n for n in owners if not prefix or n.startswith(prefix + ".")]
        if not inside:
            continue

        def after_forward(mod: nn.Module, args: Any, output: Any, inside: list[str] = inside) -> None:
            forward = log.setdefault("forward", {})
            todo = [n for n in inside if n not in forward]
            if not todo:
                return
            forward.update(_read(owners, todo))
            nodes = {t.grad_fn for t in tree_leaves(output) if isinstance(t, Tensor) and t.grad_fn is not None}
            for node in nodes:
                # A post hook of the node that made the output: it runs once the module's last
                # backward op has run, after any hook on the output's gradient and before the
                # gradients of the module's parameters are accumulated.
                def after_backward_op(grad_inputs: Any, grad_outputs: Any, todo: list[str] = todo) -> None:
                    backward = log.setdefault("backward", {})
                    for name, placement in _read(owners, todo).items():
                        backward.setdefault(name, placement)

                node.register_hook(after_backward_op)

        # First among the module's forward hooks: an engine's own post-forward hook may reshard.
        handles.append(module.register_forward_hook(after_forward, prepend=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record_training_step(
    model: nn.Module,
    names: list[str],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    batch: tuple[Any, ...],
    loss_fn: Callable[[Any], Tensor],
    summon: Callable[..., ContextManager[None]] | None = None,
    summon_offload_to_cpu: bool = True,
    no_sync: Callable[[], ContextManager[None]] | None = None,
) -> PlacementLog:
    """One training step of a freshly wrapped ``model`` and the placements at every point.

    ``names``: :func:`original_names` of the model before wrapping. ``summon(**kwargs)``: the
    engine's ``summon_full_params`` bound to ``model`` (``writeback`` and ``offload_to_cpu`` are
    passed); ``no_sync()``: its ``no_sync``. Either may be None for an engine without it.
    """
    log: PlacementLog = {"after_construction": observe_parameters(model)}
    optimizer = make_optimizer(model.parameters())
    with observe_compute(model, names, log):
        loss = loss_fn(model(*batch))
        log["after_forward"] = observe_parameters(model)
        loss.backward()
    log["after_backward"] = observe_parameters(model)
    optimizer.step()
    log["after_step"] = observe_parameters(model)
    if summon is not None:
        with summon(writeback=True):
            log["in_summon"] = observe_parameters(model)
        log["after_summon"] = observe_parameters(model)
        if summon_offload_to_cpu:
            with summon(writeback=False, offload_to_cpu=True):
                log["in_summon_offload_to_cpu"] = observe_parameters(model)
            log["after_summon_offload_to_cpu"] = observe_parameters(model)
    if no_sync is not None:
        optimizer.zero_grad()
        with no_sync():
            loss_fn(model(*batch)).backward()
            log["in_no_sync"] = observe_parameters(model)
        loss_fn(model(*batch)).backward()
        log["after_no_sync"] = observe_parameters(model)
        optimizer.step()
    return log


@dataclass(frozen=True)
class Violation:
    """A parameter or gradient that is not where the configuration promises."""

    point: str
    name: str
    #: ``"parameter"`` or ``"gradient"``.
    what: str
    found: str
    expected: str

    def __str__(self) -> str:
        return f"{self.what} {self.name} at {self.point}: on {self.found}, expected {self.expected}"


def _expected_under_offload(point: str, compute_device: str) -> tuple[str | None, str | None]:
    """(parameter, gradient) device type ``CPUOffload(offload_params=True)`` promises at ``point``;
    None where it promises nothing (gradients inside ``no_sync`` accumulate where compute runs)."""
    if point in COMPUTE_POINTS:
        return compute_device, None
    if point == "in_summon":
        return compute_device, None
    if point == "in_summon_offload_to_cpu":
        return "cpu", None
    if point == "in_no_sync":
        return "cpu", None
    if point == "after_forward":
        # SHARD_GRAD_OP keeps the unsharded parameters for backward; other strategies show the
        # shard. Checked by the side-by-side comparison, not promised by the option alone.
        return None, None
    return "cpu", "cpu"


def offload_violations(log: PlacementLog, compute_device: str) -> list[Violation]:
    """Every parameter and gradient that parameter offload puts elsewhere than it promises: the
    CPU outside forward and backward, the compute device (type, e.g. ``"cuda"``) while computing
    and inside ``summon_full_params`` (the CPU with ``offload_to_cpu``)."""
    found: list[Violation] = []
    for point, placement in log.items():
        want_param, want_grad = _expected_under_offload(point, compute_device)
        for name, (param, grad) in sorted(placement.items()):
            if want_param is not None and torch.device(param).type != want_param:
                found.append(Violation(point, name, "parameter", param, want_param))
            if want_grad is not None and grad is not None and torch.device(grad).type != want_grad:
                found.append(Violation(point, name, "gradient", grad, want_grad))
    return found
