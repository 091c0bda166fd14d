"""Our FSDP engine with torch FSDP1's public API (never imports ``torch.distributed.fsdp``)."""

from engine.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from engine.flat_param import FlatParameter, FlatParamHandle, HandleShardingStrategy
from engine.fully_sharded import FSDP, FullyShardedDataParallel
from engine.grad_scaler import ShardedGradScaler

__all__ = [
    "BackwardPrefetch",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "StateDictConfig",
    "StateDictSettings",
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
