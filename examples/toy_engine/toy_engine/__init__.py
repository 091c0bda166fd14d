"""A toy FSDP engine with torch FSDP1's public API: the project's engine re-exported under another name.

It stands for any engine built outside the project. ``toy_engine.buggy`` is the same engine with one
planted bug; ``toy_engine.registration`` registers both with the harness (entry points of the group
``fsdp_parity.engines`` in pyproject.toml).
"""

from engine import (
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    FlatParameter,
    FlatParamHandle,
    FullStateDictConfig,
    FullyShardedDataParallel,
    HandleShardingStrategy,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedGradScaler,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FSDP",
    "FlatParamHandle",
    "FlatParameter",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "HandleShardingStrategy",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ShardedGradScaler",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictType",
]
