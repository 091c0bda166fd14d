"""Bad inputs to FlatParamHandle: each raises ValueError naming the parameter and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from engine.flat_param import FlatParamHandle
from harness.conformance.flat_handles import handle_kwargs


def _construct(module: nn.Module, params: list[Any] | None = None, **overrides: Any) -> FlatParamHandle:
    kwargs = handle_kwargs(rank=0, world_size=2, use_orig_params=False)
    kwargs.update(overrides)
    return FlatParamHandle(list(module.parameters()) if params is None else params, module, **kwargs)


def _raises_naming(module: nn.Module, name: str, remedy: str, **overrides: Any) -> str:
    """Construct over ``module``; the ValueError must name ``name`` and say ``remedy``."""
    with pytest.raises(ValueError) as excinfo:
        _construct(module, **overrides)
    message = str(excinfo.value)
    assert f"'{name}'" in message, f"the error does not name parameter {name!r}: {message}"
    assert remedy in message, f"the error does not say what to change ({remedy!r}): {message}"
    return message


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_empty_parameter_list(use_orig_params: bool) -> None:
    with pytest.raises(ValueError, match=r"^Cannot construct a FlatParamHandle with an empty parameter list$"):
        _construct(nn.Linear(2, 2), params=[], use_orig_params=use_orig_params)


def test_mixed_dtypes() -> None:
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2, dtype=torch.float16))
    message = _raises_naming(module, "1.weight", "cast the module to one dtype")
    assert "torch.float16" in message and "torch.float32" in message


def test_mixed_devices() -> None:
    # The meta device stands in for a second device on a CPU-only machine.
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2, device="meta"))
    message = _raises_naming(module, "1.weight", "move the module to one device")
    assert "meta" in message and "cpu" in message


@pytest.mark.parametrize("first", [True, False], ids=["integer-first", "integer-last"])
def test_integer_parameter(first: bool) -> None:
    module = nn.Module()
    steps = nn.Parameter(torch.arange(3), requires_grad=False)
    if first:
        module.register_parameter("steps", steps)
    module.lin = nn.Linear(2, 2)
    if not first:
        module.register_parameter("steps", steps)
    _raises_naming(module, "steps", "register it as a buffer")


def test_already_flat_parameter() -> None:
    inner = nn.Linear(2, 2)
    flat = _construct(inner).flat_param
    holder = nn.Module()
    holder.flat = flat
    _raises_naming(holder, "flat", "wrap the original module")


def test_scalar_parameter() -> None:
    module = nn.Module()
    module.lin = nn.Linear(2, 2)
    module.scale = nn.Parameter(torch.tensor(1.0))
    _raises_naming(module, "scale", "reshape it to shape (1,)")


def test_mixed_requires_grad_without_use_orig_params() -> None:
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    module[1].weight.requires_grad_(False)
    _raises_naming(module, "1.weight", "use_orig_params=True")
    # With use_orig_params frozen and trainable parameters may share a flat parameter (FSDP1's rule).
    assert _construct(module, use_orig_params=True).flat_param.requires_grad


def test_parameter_outside_module() -> None:
    module = nn.Linear(2, 2)
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not registered in Linear's module tree"):
        _construct(module, params=[module.weight, stranger])


def test_fsdp_extension_refused() -> None:
    with pytest.raises(ValueError, match="fsdp_extension"):
        _construct(nn.Linear(2, 2), fsdp_extension=object())
