"""Ports of torch's test_fsdp_flatten_params.py that need no runtime (one process, CPU).

The shard-metadata tables are checked on our handle and on torch FSDP1's own FlatParamHandle:
the second run guards the transcription of the tables, the first is the conformance check.
The torch test's checks that need a wrapped forward (partial flattening, outputs, pnorm after a step,
the empty module) belong with the runtime suites.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

from engine import flat_param as engine_flat_param
from engine.flat_param import FlatParamHandle, FlatParamShardMetadata
from harness.conformance.flat_handles import flatten_params_transformer, handle_kwargs

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


@dataclass(frozen=True)
class Implementation:
    """A FlatParamHandle implementation: ours or torch FSDP1's (same constructor and metadata API)."""

    name: str
    handle_cls: Any
    strategy_enum: Any

    def handle(self, module: nn.Module, params: list[nn.Parameter] | None = None, **overrides: Any) -> Any:
        kwargs = handle_kwargs(rank=0, world_size=1, use_orig_params=False, strategy_enum=self.strategy_enum)
        kwargs.update(overrides)
        return self.handle_cls(list(module.parameters()) if params is None else params, module, **kwargs)


@pytest.fixture(params=["engine", "torch_fsdp1"])
def impl(request: pytest.FixtureRequest) -> Implementation:
    if request.param == "engine":
        return Implementation("engine", FlatParamHandle, engine_flat_param.HandleShardingStrategy)
    torch_flat = pytest.importorskip(
        "torch.distributed.fsdp._flat_param", reason="torch built without distributed: no FSDP1 reference"
    )
    return Implementation("torch_fsdp1", torch_flat.FlatParamHandle, torch_flat.HandleShardingStrategy)


def _probe(handle: Any, start: int, end: int) -> Any:
    """Shard metadata for the inclusive unsharded range ``[start, end]``, as if it were this rank's."""
    handle.flat_param._shard_param_infos = handle._get_shard_metadata(start, end)
    return handle.shard_metadata()


def test_flat_param_shard_metadata_aligned_full_precision(impl: Implementation) -> None:
    """fp32 aligns each parameter to 4 elements: 21 + (3) + 35 + (1) + 25 = 85 elements."""
    module = nn.Sequential(nn.Linear(3, 7, bias=False), nn.Linear(7, 5, bias=False), nn.Linear(5, 5, bias=False))
    handle = impl.handle(module, use_orig_params=True)
    assert tuple(handle.flat_param._numels_with_padding) == (21, 3, 35, 1, 25)
    assert tuple(handle.flat_param._is_padding_mask) == (False, True, False, True, False)
    assert handle.flat_param.numel() == 85
    # Rank 0 of 2: 21 + (3) + 19 = 43 elements.
    assert _probe(handle, 0, 42) == FlatParamShardMetadata(
        param_names=("0.weight", "1.weight"),
        param_shapes=((7, 3), (5, 7)),
        param_strides=((3, 1), (7, 1)),
        param_contiguities=(True, True),
        param_numels=(21, 35),
        param_offsets=((0, 20), (0, 18)),
    )
    # Rank 1 of 2: 16 + (1) + 25 = 42 elements (the torch test's end index, one past the buffer, is kept).
    assert _probe(handle, 43, 85) == FlatParamShardMetadata(
        param_names=("1.weight", "2.weight"),
        param_shapes=((5, 7), (5, 5)),
        param_strides=((7, 1), (5, 1)),
        param_contiguities=(True, True),
        param_numels=(35, 25),
        param_offsets=((19, 34), (0, 24)),
    )


def test_flat_param_shard_metadata_aligned_mixed_precision(impl: Implementation) -> None:
    """fp16 compute aligns each parameter to 8 elements: 10 + (6) + 25 + (7) + 15 = 63 elements."""
    module = nn.Sequential(nn.Linear(2, 5, bias=False), nn.Linear(5, 5, bias=False), nn.Linear(5, 3, bias=False))
    handle = impl.handle(module, use_orig_params=True, mp_param_dtype=torch.float16)
    assert tuple(handle.flat_param._numels_with_padding) == (10, 6, 25, 7, 15)
    assert tuple(handle.flat_param._is_padding_mask) == (False, True, False, True, False)
    assert handle.flat_param.numel() == 63
    # Rank 0 of 2: 10 + (6) + 16 = 32 elements.
    assert _probe(handle, 0, 31) == FlatParamShardMetadata(
        param_names=("0.weight", "1.weight"),
        param_shapes=((5, 2), (5, 5)),
        param_strides=((2, 1), (5, 1)),
        param_contiguities=(True, True),
        param_numels=(10, 25),
        param_offsets=((0, 9), (0, 15)),
    )
    # Rank 1 of 2: 9 + (7) + 15 = 31 elements.
    assert _probe(handle, 32, 63) == FlatParamShardMetadata(
        param_names=("1.weight", "2.weight"),
        param_shapes=((5, 5), (3, 5)),
        param_strides=((5, 1), (5, 1)),
        param_contiguities=(True, True),
        param_numels=(25, 15),
        param_offsets=((16, 24), (0, 14)),
    )


@pytest.mark.parametrize("half", [False, True])
def test_flatten_nothing(impl: Implementation, half: bool) -> None:
    module = flatten_params_transformer()
    if half:
        module = module.half()
    with pytest.raises(ValueError, match="Cannot construct a FlatParamHandle with an empty parameter list"):
        impl.handle(module, params=[])


@pytest.mark.parametrize("half", [False, True])
def test_numel_without_shared_params(impl: Implementation, half: bool) -> None:
    module = flatten_params_transformer()
    if half:
        module = module.half()
    ref_numel = sum(p.numel() for p in module.parameters())
    handle = impl.handle(module)
    assert handle.flat_param.numel() == ref_numel
    assert list(handle.shared_param_module_names()) == []


@pytest.mark.parametrize("half", [False, True])
def test_numel_with_shared_params(impl: Implementation, half: bool) -> None:
    module = flatten_params_transformer(shared=True)
    if half:
        module = module.half()
    # parameters() counts each shared parameter once; so must the flat parameter.
    ref_numel = sum(p.numel() for p in module.parameters())
    handle = impl.handle(module)
    assert handle.flat_param.numel() == ref_numel
    assert sorted(handle.shared_param_module_names()) == [
        ("weight", f"decoder.layers.{i}.{name}") for i in range(2) for name in ("linear1", "linear2")
    ]


def test_param_module_names_include_shared(impl: Implementation) -> None:
    """FSDP1's param_module_names() yields every registration, shared ones after the unique ones
    (the full state dict is built from it); shared_param_module_names() yields only the shared."""
    module = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    module[1].weight = module[0].weight
    handle = impl.handle(module)
    assert list(handle.param_module_names()) == [("weight", "0"), ("weight", "1")]
    assert list(handle.shared_param_module_names()) == [("weight", "1")]
