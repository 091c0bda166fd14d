"""The toy engine with one planted bug: gradients are reduced in the parameter dtype, whatever
``MixedPrecision.reduce_dtype`` says (with no ``param_dtype``: in full precision).

A realistic slip: the reduction reuses the dtype the parameters were gathered in. Numerically it is
nearly invisible (the reduction is as precise or more), so only a check that looks at what the
collectives carry catches it: the certificate's ``knobs`` family.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import engine
from toy_engine import (
    FSDP as _FSDP,  # noqa: F401 - the clean class stays reachable for comparison
    BackwardPrefetch,
    CPUOffload,
    FlatParameter,
    FlatParamHandle,
    FullStateDictConfig,
    HandleShardingStrategy,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedGradScaler,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from toy_engine.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__version__ = "0.1.0+reduce-dtype-bug"


class FullyShardedDataParallel(engine.FullyShardedDataParallel):
    """``engine.FullyShardedDataParallel`` that drops ``reduce_dtype`` (the planted bug)."""

    def __init__(self, module: Any, *args: Any, mixed_precision: MixedPrecision | None = None, **kwargs: Any) -> None:
        if mixed_precision is not None:
            mixed_precision = dataclasses.replace(mixed_precision, reduce_dtype=mixed_precision.param_dtype)
        super().__init__(module, *args, mixed_precision=mixed_precision, **kwargs)


FSDP = FullyShardedDataParallel

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CustomPolicy",
    "FSDP",
    "FlatParamHandle",
    "FlatParameter",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "HandleShardingStrategy",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "ShardedGradScaler",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictType",
    "always_wrap_policy",
    "enable_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
