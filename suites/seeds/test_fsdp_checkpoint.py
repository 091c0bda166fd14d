"""Seed behaviours of torch's test_fsdp_checkpoint.py, as conformance checks against every engine with
torch FSDP1's API (``fsdp_api``: our engine and torch FSDP1), 2 ranks on the CPU and on the GPUs: activation
checkpointing (``checkpoint_wrapper``, reentrant and non-reentrant) inside the units
(``FSDP(checkpoint_wrapper(block))``) and around them (``checkpoint_wrapper(FSDP(block))``), so the
recomputed forward runs the units' forward hooks again inside backward. Each trains against the unsharded
local reference over FULL_SHARD and SHARD_GRAD_OP, with flat and original parameters.
"""

from __future__ import annotations

import itertools

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from harness.rank import rank_device
from suites.engine.ranks import api_session_tests
from suites.seeds.api import FSDPApi, load_api, train_parity

IMPLS = {"reentrant": CheckpointImpl.REENTRANT, "non_reentrant": CheckpointImpl.NO_REENTRANT}


def _parity(api: FSDPApi, impl: str, around: bool) -> None:
    kinds = [api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP]
    for strategy, orig in itertools.product(kinds, [False, True]):

        def wrap(module: nn.Module, **kwargs: object) -> nn.Module:
            # The innermost units (the linears) are checkpointed; the block and the root are not.
            if type(module) is not nn.Linear:
                return api.wrap(module, **kwargs)
            if around:
                return checkpoint_wrapper(api.wrap(module, **kwargs), checkpoint_impl=IMPLS[impl])
            return api.wrap(checkpoint_wrapper(module, checkpoint_impl=IMPLS[impl]), **kwargs)

        train_parity(api, "engine_nested", dict(sharding_strategy=strategy, use_orig_params=orig), rank_device(),
                     reference="local", steps=3, wrap=wrap)


def check_checkpoint_inside_units_reentrant(api: FSDPApi, rank: int, world_size: int) -> None:
    _parity(api, "reentrant", around=False)


def check_checkpoint_inside_units_non_reentrant(api: FSDPApi, rank: int, world_size: int) -> None:
    _parity(api, "non_reentrant", around=False)


def check_units_inside_checkpoint_reentrant(api: FSDPApi, rank: int, world_size: int) -> None:
    _parity(api, "reentrant", around=True)


def check_units_inside_checkpoint_non_reentrant(api: FSDPApi, rank: int, world_size: int) -> None:
    """The recomputation in backward runs the unit's forward after its pre-backward unsharded it, and
    a non-reentrant recomputation stops before the unit's post-forward: FSDP1 skips both hooks then."""
    _parity(api, "non_reentrant", around=True)


CHECKS = [
    check_checkpoint_inside_units_reentrant,
    check_checkpoint_inside_units_non_reentrant,
    check_units_inside_checkpoint_reentrant,
    check_units_inside_checkpoint_non_reentrant,
]
session, test_check = api_session_tests(CHECKS, load_api, device=("cpu", "cuda"))
