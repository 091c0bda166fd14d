"""Public enums and configuration dataclasses, with torch FSDP1's names and members.

Users and PyTorch's FSDP tests speak FSDP1's API, so these mirror it exactly; they are our own classes (the
engine never imports ``torch.distributed.fsdp``), so code that checks ``isinstance`` against
torch's classes will not accept ours and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Sequence

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "ShardingStrategy",
    "StateDictType",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "OptimStateKeyType",
    "StateDictSettings",
]


class ShardingStrategy(Enum):
    """How parameters, gradients and optimizer state are split across ranks."""

    #: parameters, gradients and optimizer state sharded; parameters re-gathered for backward.
    FULL_SHARD = auto()
    #: gradients and optimizer state sharded; parameters stay unsharded from forward to backward.
    SHARD_GRAD_OP = auto()
    #: nothing sharded: DDP semantics, gradients all-reduced.
    NO_SHARD = auto()
    #: FULL_SHARD inside a shard group, replicated (all-reduced) across the replicate group.
    HYBRID_SHARD = auto()
    #: SHARD_GRAD_OP inside a shard group, replicated across the replicate group.
    _HYBRID_SHARD_ZERO2 = auto()


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(Enum):
    """When to issue the next unit's all-gather during backward."""

    #: before the current unit's gradient computation (more overlap, more memory).
    BACKWARD_PRE = auto()
    #: after the current unit's gradient computation (its unsharded parameters are freed first).
    BACKWARD_POST = auto()


@dataclass
class CPUOffload:
    """Keep sharded parameters and gradients on CPU; the optimizer steps there."""

    #: True: parameters move to the compute device only for forward and backward.
    offload_params: bool = False


@dataclass
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers, with FSDP1's fields and semantics.

    The sharded parameters (and the optimizer) stay in their own, full-precision dtype. Before
    each all-gather the local shard is copied to ``param_dtype`` (the copy is freed once gathered),
    compute runs on the gathered low-precision parameters, and gradients are reduced in
    ``reduce_dtype`` and cast back to the full-precision dtype. A unit's own setting applies to
    the modules it manages; ``FSDP_USE_FULL_PREC_IN_EVAL=1`` turns it off in eval mode (see
    ``engine.precision``).
    """

    #: dtype of parameters during forward and backward (and of the all-gather); None: unchanged.
    param_dtype: torch.dtype | None = None
    #: dtype of gradient reduction; None: ``param_dtype`` if given, else the parameter dtype.
    reduce_dtype: torch.dtype | None = None
    #: dtype floating-point buffers are cast to at the root's first forward; None: unchanged.
    #: State dicts still save buffers in their original dtype.
    buffer_dtype: torch.dtype | None = None
    #: True: gradients stay in ``param_dtype`` after reduction instead of the parameter dtype.
    keep_low_precision_grads: bool = False
    #: True: every unit (with parameters) casts its floating-point forward inputs to ``param_dtype``.
    cast_forward_inputs: bool = False
    #: True: the root casts its floating-point forward inputs to ``param_dtype`` (integer
    #: inputs, e.g. token ids, are never cast).
    cast_root_forward_inputs: bool = True
    #: module classes an auto-wrap policy gives their own full-precision unit (with a warning).
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)


class StateDictType(Enum):
    """Which state dict ``state_dict()`` returns (selected with ``FSDP.state_dict_type``)."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the state-dict configurations."""

    #: True: tensors are copied to CPU.
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    #: True: only rank 0 (of each unit's shard group) materializes the full state dict; the other
    #: ranks take part in the gathers and get an empty dict.
    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Values are ``DTensor``s over the shard group, each rank holding its dim-0 chunk."""


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Values are the flat shards, one ``ShardedTensor`` per unit under ``<unit>._flat_param``."""


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configurations (FSDP1 offloads optimizer state by default)."""

    #: True: tensors are copied to CPU.
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    #: True: only rank 0 of the group gets the state (others an empty dict); loading broadcasts
    #: rank 0's state to the others.
    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Per-parameter state as ``DTensor``s over the shard group, like the model's sharded state."""


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    """What ``set_state_dict_type`` returns (the previous settings) and ``get_state_dict_type`` reports."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """How ``rekey_optim_state_dict`` keys the state: by parameter name or by position."""

    PARAM_NAME = auto()
    PARAM_ID = auto()
