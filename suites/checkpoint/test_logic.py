"""State-dict settings and names as plain data, without processes: defaults and fields as torch
FSDP1's, torch's config objects converted, clean names."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed.fsdp as torch_fsdp

import engine
from engine.state_dict_config import _convert_config, clean_fqn

#: Every state-dict configuration class torch FSDP1 exports: each must exist in ours, alike.
CONFIGS = sorted(name for name in torch_fsdp.__all__ if name.endswith("StateDictConfig"))


@pytest.mark.parametrize("name", CONFIGS)
def test_config_defaults_match_torch(name: str) -> None:
    ours, theirs = getattr(engine, name)(), getattr(torch_fsdp, name)()
    public = {f.name for f in dataclasses.fields(ours)}
    assert public == {f.name for f in dataclasses.fields(theirs) if not f.name.startswith("_")}
    for field in public:
        assert getattr(ours, field) == getattr(theirs, field), f"{name}.{field}"


def test_torch_config_objects_are_converted() -> None:
    converted = _convert_config(torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True), engine.FullStateDictConfig, "x")
    assert converted == engine.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with pytest.raises(RuntimeError, match="Expected x of type FullStateDictConfig but got ShardedStateDictConfig"):
        _convert_config(torch_fsdp.ShardedStateDictConfig(), engine.FullStateDictConfig, "x")


def test_enums_have_torch_members() -> None:
    assert [m.name for m in engine.StateDictType] == [m.name for m in torch_fsdp.StateDictType]
    assert [m.name for m in engine.OptimStateKeyType] == [m.name for m in torch_fsdp.OptimStateKeyType]


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("_fsdp_wrapped_module.inp.weight", "inp.weight"),
        ("_fsdp_wrapped_module.block._fsdp_wrapped_module.0._fsdp_wrapped_module.weight", "block.0.weight"),
        ("_fsdp_wrapped_module", ""),
        ("layers.0._checkpoint_wrapped_module.ff.bias", "layers.0.ff.bias"),
        ("plain.weight", "plain.weight"),
    ],
)
def test_clean_fqn(raw: str, clean: str) -> None:
    assert clean_fqn(raw) == clean
