"""Our FSDP engine with torch FSDP1's public API (never imports ``torch.distributed.fsdp``)."""

from engine.api import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from engine.flat_param import FlatParameter, FlatParamHandle, HandleShardingStrategy
from engine.fully_sharded import FSDP, FullyShardedDataParallel
from engine.grad_scaler import ShardedGradScaler

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
