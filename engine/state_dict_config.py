"""Which state dict the units produce: ``set_state_dict_type``/``get_state_dict_type`` and their context.

Every unit of a tree records the same :class:`~engine.api.StateDictType` and configurations;
the state-dict code (:mod:`engine.state_dict`, :mod:`engine.optim_state`) reads them from the unit.
Torch's own enum and configuration objects are accepted too (converted by name and fields), so code
written against ``torch.distributed.fsdp`` drives this engine unchanged.

This module also holds what the state-dict modules share about a wrapper without importing it: the
:class:`FsdpState` protocol, how to find every unit under a module, and clean parameter names.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Protocol

import torch.distributed as dist
import torch.nn as nn

from engine.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from engine.unit import FsdpUnit

__all__ = [
    "FSDP_PREFIX",
    "FLAT_PARAM",
    "FsdpState",
    "clean_fqn",
    "effective_settings",
    "fsdp_states",
    "get_state_dict_type",
    "set_state_dict_type",
    "state_dict_type",
]

FLAT_PARAM = "_flat_param"
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
#: name segments the wrappers add; clean names drop them (torch's activation-checkpoint wrapper too).
_WRAPPER_SEGMENTS = frozenset({FSDP_WRAPPED_MODULE, "_checkpoint_wrapped_module"})

_MODEL_CONFIGS: dict[StateDictType, type[StateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
}
_OPTIM_CONFIGS: dict[StateDictType, type[OptimStateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig,
}


class FsdpState(Protocol):
    """What the state-dict code reads of a ``FullyShardedDataParallel`` instance."""

    _unit: FsdpUnit | None
    _sharding_strategy: ShardingStrategy
    _state_dict_type: StateDictType
    _state_dict_config: StateDictConfig
    _optim_state_dict_config: OptimStateDictConfig
    _ignored_modules: set[nn.Module]
    _is_root: bool | None
    process_group: dist.ProcessGroup
    rank: int
    world_size: int

    @property
    def module(self) -> nn.Module: ...


def is_fsdp(module: nn.Module) -> bool:
    return getattr(type(module), "_is_fsdp_unit", False)


def fsdp_states(module: nn.Module) -> list[Any]:
    """Every unit in ``module``'s tree, in module order (``module`` first if it is one)."""
    return [m for m in module.modules() if is_fsdp(m)]


def clean_fqn(name: str) -> str:
    """``name`` without the wrappers' segments, as torch FSDP1's clean names."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _as_state_dict_type(value: Any) -> StateDictType:
    if isinstance(value, StateDictType):
        return value
    name = getattr(value, "name", None)
    if name in StateDictType.__members__:
        return StateDictType[name]
    raise ValueError(
        f"state_dict_type={value!r} must be a StateDictType member (FULL_STATE_DICT, "
        "SHARDED_STATE_DICT or LOCAL_STATE_DICT)"
    )


def _convert_config(config: Any, expected: type, what: str) -> Any:
    """``config`` as an instance of our ``expected`` class; torch's classes of the same name are
    converted field by field (duck typing)."""
    if config is None:
        return expected()
    if type(config) is expected:
        return config
    if type(config).__name__ == expected.__name__:
        fields = {f: getattr(config, f) for f in expected.__dataclass_fields__ if hasattr(config, f)}
        return expected(**fields)
    raise RuntimeError(
        f"Expected {what} of type {expected.__name__} but got {type(config).__name__}: pass the "
        "configuration class that matches the state_dict_type"
    )


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> StateDictSettings:
    """Set the type and configurations on every unit under ``module``; returns the previous ones."""
    sd_type = _as_state_dict_type(state_dict_type)
    sd_config = _convert_config(state_dict_config, _MODEL_CONFIGS[sd_type], "state_dict_config")
    osd_config = _convert_config(optim_state_dict_config, _OPTIM_CONFIGS[sd_type], "optim_state_dict_config")
    states = fsdp_states(module)
    previous = _common_settings(states) if states else None
    for s in states:
        s._state_dict_type = sd_type
        s._state_dict_config = sd_config
        s._optim_state_dict_config = osd_config
    if previous is None:
        return StateDictSettings(sd_type, sd_config, osd_config)
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings every unit under ``module`` shares (an error if they differ or there is none)."""
    states = fsdp_states(module)
    if not states:
        raise ValueError(
            f"get_state_dict_type: {type(module).__name__} contains no FullyShardedDataParallel unit"
        )
    return _common_settings(states)


def _common_settings(states: list[Any]) -> StateDictSettings:
    first = StateDictSettings(states[0]._state_dict_type, states[0]._state_dict_config, states[0]._optim_state_dict_config)
    for s in states[1:]:
        other = StateDictSettings(s._state_dict_type, s._state_dict_config, s._optim_state_dict_config)
        if other != first:
            raise AssertionError(
                f"All FSDP modules must have the same state dict settings; got {other} and {first}: "
                "set them on the root with FSDP.set_state_dict_type(root, ...)"
            )
    return first


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """``set_state_dict_type`` for the duration; the previous settings come back in ``finally``."""
    states = fsdp_states(module)
    saved = [(s._state_dict_type, s._state_dict_config, s._optim_state_dict_config) for s in states]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for s, (t, c, o) in zip(states, saved):
            s._state_dict_type, s._state_dict_config, s._optim_state_dict_config = t, c, o


def effective_settings(state: Any, warn: bool = False) -> tuple[StateDictType, Any]:
    """The type and model configuration ``state`` produces: NO_SHARD units give full state dicts
    for the sharded and local types (torch FSDP1 does the same, with the same warning)."""
    sd_type, config = state._state_dict_type, state._state_dict_config
    if state._sharding_strategy == ShardingStrategy.NO_SHARD and sd_type != StateDictType.FULL_STATE_DICT:
        if not warn:
            return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
        warnings.warn(
            "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
            stacklevel=3,
        )
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    return sd_type, config
