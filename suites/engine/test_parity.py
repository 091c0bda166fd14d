"""Training parity on 2 CPU ranks (gloo): every strategy x use_orig_params x backward prefetch x
forward prefetch x CPU offload, on the nested, tied-transformer and mixture-of-experts models,
against the all-data local reference and against DDP (alternating), 5 SGD-momentum steps each.

The whole cross product runs in one spawned session (about 30 s on 2 cores).
"""

from __future__ import annotations

import itertools

import torch

from engine import BackwardPrefetch, CPUOffload, ShardingStrategy
from suites.engine import parity
from suites.engine.ranks import session_tests

STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
PREFETCH = [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]


def _sweep(model: str) -> None:
    failures = []
    combos = itertools.product(STRATEGIES, [False, True], PREFETCH, [False, True], [False, True])
    for i, (strategy, orig, bwd, fwd, offload) in enumerate(combos):
        kwargs = dict(
            sharding_strategy=strategy,
            use_orig_params=orig,
            backward_prefetch=bwd,
            forward_prefetch=fwd,
            cpu_offload=CPUOffload(offload_params=offload),
        )
        # Alternate the two references so each sees every axis value.
        reference = "ddp" if i % 2 else "local"
        try:
            parity.train_parity(model, kwargs, torch.device("cpu"), reference=reference)
        except AssertionError as e:
            failures.append(f"{reference} {kwargs}: {e}")
    assert not failures, f"{len(failures)} configurations diverged:\n" + "\n".join(failures[:5])


def check_nested_sweep(rank: int, world_size: int) -> None:
    _sweep("nested")


def check_transformer_sweep(rank: int, world_size: int) -> None:
    _sweep("transformer")


def check_moe_sweep(rank: int, world_size: int) -> None:
    _sweep("moe")


def check_both_references_default_kwargs(rank: int, world_size: int) -> None:
    for model in ("nested", "transformer"):
        for reference in ("local", "ddp"):
            parity.train_parity(model, {}, torch.device("cpu"), reference=reference)


CHECKS = [check_nested_sweep, check_transformer_sweep, check_moe_sweep, check_both_references_default_kwargs]
session, test_check = session_tests(CHECKS)
