"""One FSDP instance's configuration, made once from the constructor's arguments and handed down.

:class:`UnitConfig` is frozen: the wrapper builds it after checking its arguments, resolving its
process groups and choosing its compute device, and the module state, the unit and the flat-parameter
handle all read the same object instead of each taking the settings as scalars. What follows from
the strategy (whether the unit shards, is hybrid, frees its parameters after forward) is decided here
and nowhere else.

The device rules are torch FSDP1's (``_init_device_handle``, ``_get_device_from_device_id``,
``_materialize_meta_module``, ``_get_compute_device``): they look at ``device_id``, the parameters and
the current accelerator device, never at the communication backend. The one difference: on a host
without an accelerator torch FSDP1 refuses a module with no ``device_id``; ours computes on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from engine.api import HYBRID_STRATEGIES, BackwardPrefetch, MixedPrecision, ShardingStrategy

__all__ = [
    "RESHARD_AFTER_FORWARD_STRATEGIES",
    "RankAndSize",
    "UnitConfig",
    "choose_compute_device",
    "current_accelerator_device",
    "hybrid_node_size",
    "materialization_device",
    "skip_writeback_check",
]

#: strategies that free the unsharded parameters after forward (and gather them again for backward);
#: the others keep them from forward to backward.
RESHARD_AFTER_FORWARD_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def skip_writeback_check() -> bool:
    """``FSDP_SKIP_WRITEBACK_CHECK=1`` turns off detection of user changes to original parameters."""
    return os.environ.get("FSDP_SKIP_WRITEBACK_CHECK", "0") == "1"


class RankAndSize(Protocol):
    """What the flat-parameter handle needs of a process group: a real one or a test double."""

    def rank(self) -> int: ...

    def size(self) -> int: ...


@dataclass(frozen=True)
class UnitConfig:
    """How one instance shards, computes and reduces."""

    #: the strategy in effect: a non-hybrid strategy on a one-rank group is already NO_SHARD here.
    strategy: ShardingStrategy
    #: where the unsharded parameters live during forward and backward.
    compute_device: torch.device
    #: the group the parameters are sharded over (a test double with ``rank()``/``size()`` for a
    #: handle built without a runtime).
    shard_group: Any
    #: hybrid strategies: the group the reduced shard is all-reduced across; None otherwise.
    replicate_group: Any = None
    #: the sharded parameters (and their gradients) live on the CPU between forward and backward.
    offload_params: bool = False
    #: None: compute, reduce and keep buffers in the parameters' own dtype.
    mixed_precision: MixedPrecision | None = None
    #: the original parameters stay ``nn.Parameter`` objects viewing the flat parameter.
    use_orig_params: bool = False
    backward_prefetch: BackwardPrefetch | None = None
    forward_prefetch: bool = False
    #: at most two all-gathers in flight ahead of compute (CUDA only).
    limit_all_gathers: bool = True
    #: ``FSDP_USE_FULL_PREC_IN_EVAL=1`` at construction: in eval mode, ignore mixed precision.
    use_full_prec_in_eval: bool = False
    #: ``FSDP_SKIP_WRITEBACK_CHECK=1`` when the config was made: read once, as torch FSDP1's handle reads it at
    #: construction, not at every check (an environment lookup per unit and hook, on the step's host path).
    skip_writeback_check: bool = field(default_factory=skip_writeback_check)

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, ShardingStrategy):
            raise ValueError(f"sharding_strategy={self.strategy!r} must be a ShardingStrategy member")
        if self.replicate_group is not None and not self.hybrid:
            raise ValueError(f"replicate_group is only valid with a hybrid strategy, not {self.strategy}")

    @property
    def sharded(self) -> bool:
        """Whether the parameters are split across the shard group (not NO_SHARD)."""
        return self.strategy != ShardingStrategy.NO_SHARD

    @property
    def hybrid(self) -> bool:
        return self.strategy in HYBRID_STRATEGIES

    @property
    def reshard_after_forward(self) -> bool:
        """FULL_SHARD and HYBRID_SHARD free the unsharded parameters after forward."""
        return self.strategy in RESHARD_AFTER_FORWARD_STRATEGIES

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.param_dtype if self.mixed_precision is not None else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.reduce_dtype if self.mixed_precision is not None else None

    @property
    def keep_low_precision_grads(self) -> bool:
        return self.mixed_precision is not None and self.mixed_precision.keep_low_precision_grads


def current_accelerator_device() -> torch.device | None:
    """The current CUDA device, or None on a host without one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def materialization_device(device_id: torch.device | None, current: torch.device | None) -> torch.device:
    """Where meta-device states are materialized: ``device_id``, else the current accelerator device
    (``current``; the CPU where there is none)."""
    if device_id is not None:
        return device_id
    return current if current is not None else torch.device("cpu")


def choose_compute_device(
    device_id: torch.device | None, param_devices: Sequence[torch.device], current: torch.device | None
) -> torch.device:
    """torch FSDP1's compute device, from the managed parameters' devices after materialization and
    the move to ``device_id`` (which moves only what is on the CPU).

    The first parameter's device when it is not the CPU; else the current device of the device type
    ``device_id`` names (the CPU for ``device_id=cpu``), or of the current accelerator (``current``),
    or the CPU where there is none. A parameter on another device than ``device_id`` is an error.
    """
    first = param_devices[0] if param_devices else None
    if first is not None and first.type != "cpu":
        device = first
    elif device_id is not None:
        device = device_id
    else:
        device = current if current is not None else torch.device("cpu")
    if device_id is not None and device != device_id:
        raise ValueError(
            f"Inconsistent compute device and device_id: the module's parameters are on {device} but "
            f"device_id={device_id}: move the module to the CPU or to {device_id} before wrapping, or "
            "pass the device it is on"
        )
    return device


def hybrid_node_size(world_size: int, local_world_size: str | None, device_count: int) -> int:
    """How many ranks share a node, for the default hybrid groups (shard within a node, replicate
    across nodes): the launcher's ``LOCAL_WORLD_SIZE`` when set (ranks may share GPUs), else the
    number of CUDA devices, as torch FSDP1 assumes one rank per device."""
    if local_world_size:
        try:
            per_node = int(local_world_size)
        except ValueError:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={local_world_size!r} must be the number of ranks on this node (an integer)"
            ) from None
        source = f"LOCAL_WORLD_SIZE={per_node}"
    else:
        per_node = device_count
        source = f"{device_count} CUDA devices on this node"
    if per_node <= 0 or world_size % per_node:
        raise ValueError(
            f"HYBRID_SHARD without process_group needs the ranks per node to divide the world size "
            f"(world_size={world_size}, {source}): set LOCAL_WORLD_SIZE (torchrun does), or pass "
            "process_group=(shard_group, replicate_group) or a 2-D device_mesh"
        )
    return per_node
