"""CPU-offload placement checks shared by the CPU tier (our engine on gloo) and the GPU tier (our
engine and torch FSDP1 side by side on NCCL): one training step per configuration, recorded with
``harness.compare.param_devices`` at every point a user can observe.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist

from harness.cases.case import FSDP1_STRATEGIES
from harness.cases.model_protocol import to_device, wrap_bottom_up
from harness.compare.param_devices import PlacementLog, original_names, record_training_step
from harness.conformance.engine_models import ENGINE_MODELS
from harness.engines.optim import sgd
from harness.ranks.rank import new_hybrid_groups

#: the placement checks' models: the engine suites' models without the mixture of experts.
MODELS = {name: ENGINE_MODELS[name] for name in ("engine_nested", "engine_transformer")}
STRATEGY_NAMES = tuple(FSDP1_STRATEGIES.values())


def configurations(strategies: tuple[str, ...] = STRATEGY_NAMES) -> list[tuple[str, str, bool]]:
    """``(model, strategy name, use_orig_params)`` of every configuration checked."""
    return list(itertools.product(MODELS, strategies, (False, True)))


@functools.cache
def _hybrid_groups(world: object, world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard group, replicate group) of one node: shard over every rank, replicate over none.
    ``world`` keys the cache to the current default group."""
    return new_hybrid_groups(dist.get_rank(), world_size, world_size)


def offload_step(api: Any, model_name: str, strategy: str, use_orig_params: bool, device: torch.device) -> PlacementLog:
    """One offloaded training step of ``model_name`` wrapped by ``api`` (an ``FSDPApi``), recorded."""
    cls = MODELS[model_name]
    model = cls(device)
    names = original_names(model)
    # Wrapping by hand with a hybrid strategy needs its two groups spelled out (FSDP1 refuses
    # to guess them without an auto-wrap policy).
    groups = {"process_group": _hybrid_groups(dist.group.WORLD, dist.get_world_size())} if "HYBRID" in strategy else {}
    wrapped = wrap_bottom_up(
        model,
        api.wrap,
        sharding_strategy=api.ShardingStrategy[strategy],
        cpu_offload=api.CPUOffload(offload_params=True),
        use_orig_params=use_orig_params,
        **groups,
    )
    batch = to_device(cls.get_input(step=0, rank=dist.get_rank()), device)
    return record_training_step(
        wrapped,
        names,
        make_optimizer=lambda params: sgd(params, lr=0.1, momentum=0.0),
        batch=batch,
        loss_fn=functools.partial(cls.get_loss, batch),
        summon=functools.partial(api.FSDP.summon_full_params, wrapped),
        # FSDP1 refuses offload_to_cpu for NO_SHARD ("not supported yet"), which it runs every strategy
        # as on one rank.
        summon_offload_to_cpu=strategy != "NO_SHARD" and dist.get_world_size() > 1,
        no_sync=wrapped.no_sync,
    )
