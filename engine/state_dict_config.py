"""Which state dict the units produce: ``set_state_dict_type``/``get_state_dict_type`` and their context.

Every instance of a tree records the same :class:`~engine.api.StateDictSettings` in its module state
(``ModuleState.state_dict_settings``); the state-dict code (:mod:`engine.state_dict`,
:mod:`engine.optim_state`) reads them there. Torch's own enum and configuration objects are accepted
too (converted by name and fields, :mod:`engine.arguments`), so code written against
``torch.distributed.fsdp`` drives this engine unchanged.

This module also holds what the state-dict modules share: clean parameter names and the names the
wrapper adds.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch.nn as nn

from engine.arguments import as_dataclass, as_state_dict_type
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
from engine.state import ModuleState, fsdp_states

__all__ = [
    "FSDP_PREFIX",
    "FLAT_PARAM",
    "clean_fqn",
    "effective_settings",
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


def clean_fqn(name: str) -> str:
    """``name`` without the wrappers' segments, as torch FSDP1's clean names."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _convert_config(config: Any, expected: type, what: str) -> Any:
    """``config`` as an instance of our ``expected`` class (torch's class of the same name is
    converted); another configuration class is torch FSDP1's ``RuntimeError``."""
    if config is None:
        return expected()
    try:
        return as_dataclass(config, expected, what)
    except ValueError:
        if type(config).__name__ == expected.__name__:
            raise
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
    sd_type = as_state_dict_type(state_dict_type)
    sd_config = _convert_config(state_dict_config, _MODEL_CONFIGS[sd_type], "state_dict_config")
    osd_config = _convert_config(optim_state_dict_config, _OPTIM_CONFIGS[sd_type], "optim_state_dict_config")
    states = fsdp_states(module)
    previous = _common_settings(states) if states else None
    for s in states:
        s.state_dict_settings = StateDictSettings(sd_type, sd_config, osd_config)
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


def _common_settings(states: list[ModuleState]) -> StateDictSettings:
    first = states[0].state_dict_settings
    for s in states[1:]:
        other = s.state_dict_settings
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
    saved = [s.state_dict_settings for s in states]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for s, settings in zip(states, saved):
            s.state_dict_settings = settings


def effective_settings(state: ModuleState, warn: bool = False) -> tuple[StateDictType, Any]:
    """The type and model configuration ``state`` produces: NO_SHARD units give full state dicts
    for the sharded and local types (torch FSDP1 does the same, with the same warning)."""
    sd_type, config = state.state_dict_settings.state_dict_type, state.state_dict_settings.state_dict_config
    if state.config.strategy == ShardingStrategy.NO_SHARD and sd_type != StateDictType.FULL_STATE_DICT:
        if not warn:
            return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
        warnings.warn(
            "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
            stacklevel=3,
        )
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    return sd_type, config
