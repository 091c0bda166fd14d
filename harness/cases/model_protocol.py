"""What a zoo model is: the interface the harness drives a model through, and its seeding helpers.

A zoo model (``ZooModel``) builds the same parameters for the same seed on every rank, makes each
rank's batch of each step from ``(seed, step, rank)`` alone, computes its loss from its inputs and
output, and names the submodules that become sharded units (``wrap_bottom_up`` wraps them). The zoo
itself (``harness.cases.models``) defines the models and their registry on top of this.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

__all__ = ["SleepPlan", "ZooModel", "batch_generator", "gpu_sleep", "mix_seed", "seeded", "to_device", "wrap_bottom_up"]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; stable across processes and Python versions (no ``hash()``)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The CPU generator one rank's batch of one step is drawn from."""
    return torch.Generator().manual_seed(mix_seed(seed, step, rank, 0xBA7C4))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the enclosed construction under ``seed`` without reading or disturbing the global CPU RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@functools.lru_cache(maxsize=None)
def _cycles_per_ms(device_index: int) -> float:
    # torch.cuda._sleep spins for a number of GPU clock cycles; measure how many make a millisecond.
    with torch.cuda.device(device_index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        return 1_000_000 / max(start.elapsed_time(end), 1e-3)


def gpu_sleep(ms: float, device: torch.device | None = None) -> None:
    """Enqueue a sleep of ``ms`` on the current CUDA stream; nothing on CPU (see module docstring)."""
    if ms <= 0 or not torch.cuda.is_available():
        return
    if device is not None and device.type != "cuda":
        return
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    torch.cuda._sleep(int(ms * _cycles_per_ms(index)))


@dataclass(frozen=True)
class SleepPlan:
    """Where a model asks for GPU sleeps (milliseconds; 0 = none)."""

    #: before each gradient reduction collective of the backward pass (applied by the comm trace).
    before_reduce_ms: float = 0.0
    #: after backward, before the optimizer step (applied by the training loop).
    before_step_ms: float = 0.0
    #: after the rank-local modules' forward, before their unsharded parameters are freed
    #: (a forward hook the model registers itself, so it runs inside the engine's unit).
    before_free_ms: float = 0.0


class ZooModel(nn.Module):
    """Base of the zoo: the interface the harness drives a model through."""

    #: classes whose instances are wrap units; empty when a model lists its units by hand.
    wrap_classes: ClassVar[tuple[type[nn.Module], ...]] = ()
    #: the GPU sleeps this model asks for.
    sleeps: SleepPlan = SleepPlan()

    def wrap_units(self) -> list[nn.Module]:
        """Submodules that get their own unit, in pre-order (the root is always a unit too)."""
        return [m for m in self.modules() if m is not self and isinstance(m, self.wrap_classes)]

    def rank_local_modules(self) -> list[nn.Module]:
        """Submodules whose parameters are one rank's own and never reduced; each is also a wrap unit."""
        return []

    def auto_wrap_policy(self) -> Callable[..., bool]:
        """``wrap_units()`` as an FSDP1 callable auto-wrap policy (``policy(module, recurse, nonwrapped_numel)``).

        For engines driven through ``auto_wrap_policy``; rank-local modules need their own process
        group, which a policy cannot give, so the harness's adapters wrap by hand instead.
        """
        units = {id(m) for m in self.wrap_units()}

        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return True if recurse else id(module) in units

        return policy

    def null_gradient_ranges(self) -> dict[str, tuple[int, int]]:
        """Elements ``[start, stop)`` of a parameter (by name) whose gradient is zero in exact arithmetic.

        Every ``nn.MultiheadAttention``'s key bias (the middle third of ``in_proj_bias``): adding one
        constant to every key shifts each attention row's scores by one constant, which softmax ignores.
        What trains it is rounding noise, which Adam scales to steps of up to its learning rate.
        """
        ranges = {}
        for name, module in self.named_modules():
            if isinstance(module, nn.MultiheadAttention) and module.in_proj_bias is not None:
                width = module.in_proj_bias.numel() // 3
                ranges[f"{name}.in_proj_bias"] = (width, 2 * width)
        return ranges

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def to_device(inputs: Iterable[torch.Tensor], device: torch.device | str,
              float_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Move a batch from ``get_input`` to ``device``; with ``float_dtype``, floating tensors take that
    dtype (the master dtype: fp64 cases train in fp64) and integer ones keep theirs."""
    return tuple(t.to(device=device, dtype=float_dtype if float_dtype is not None and t.is_floating_point() else t.dtype)
                 for t in inputs)


def wrap_bottom_up(model: ZooModel, wrap: Callable[..., nn.Module], wrap_local: Callable[..., nn.Module] | None = None,
                   **kwargs: Any) -> nn.Module:
    """Wrap ``model``'s units deepest first, each put back in its parent's slot, then the root.

    Every unit and the root go through ``wrap(module, **kwargs)`` (an FSDP1-API wrapper class, or a
    closure); the rank-local units through ``wrap_local(module, **kwargs)`` (default: ``wrap``). A unit
    is wrapped after the units inside it (FSDP1's nested wrapping). Returns the wrapped root. FSDP2's
    ``fully_shard`` works in place and returns its argument, so putting it back is harmless.
    """
    depth = {id(m): name.count(".") + 1 if name else 0 for name, m in model.named_modules()}
    slots: dict[int, tuple[nn.Module, str]] = {}
    for parent in model.modules():
        for child_name, child in parent.named_children():
            slots.setdefault(id(child), (parent, child_name))
    local = {id(m) for m in model.rank_local_modules()}
    # Stable sort: units of one depth keep wrap_units()' order.
    for unit in sorted(model.wrap_units(), key=lambda m: -depth[id(m)]):
        parent, slot = slots[id(unit)]
        setattr(parent, slot, (wrap_local or wrap)(unit, **kwargs) if id(unit) in local else wrap(unit, **kwargs))
    return wrap(model, **kwargs)
