"""Stream ordering of a sharded unit on one GPU: the all-gather stream under GPU sleeps.

On one rank the FSDP1-API engines run FULL_SHARD and SHARD_GRAD_OP as NO_SHARD, so nothing goes
through the all-gather of a sharded unit. Hybrid sharding with one-rank shard and replicate groups
stays sharded in our engine (the gather, the reduce-scatter and the replicas' all-reduce all run,
on groups of one), so one GPU checks what the per-iteration ordering of the all-gather stream must
guarantee: no gather reads a shard before the optimizer step that writes it is done (the sleep
before the step), and no free or reduction overtakes compute (the other two sleeps). With bf16
parameters the gather also casts on its stream. The 2-GPU tier runs the same sleeps on every
strategy (``test_gpu.py``).

    PYTHONPATH=. python3 -m pytest suites/engine/test_gpu_streams.py -m gpu -q
"""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from engine import CPUOffload, ShardingStrategy
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.pytest_plugin import needs_gpus
from suites.engine.delays import DELAYS, delayed_step_parity

pytestmark = [pytest.mark.gpu, needs_gpus(1)]


def check_one_rank_hybrid_under_sleeps(rank: int, world_size: int) -> None:
    groups = (dist.new_group([0]), dist.new_group([0]))
    for strategy, orig, offload in itertools.product(
        (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2), (False, True), (False, True)
    ):
        kwargs = dict(sharding_strategy=strategy, process_group=groups, use_orig_params=orig,
                      cpu_offload=CPUOffload(offload), forward_prefetch=True)
        for plan in DELAYS:
            delayed_step_parity(kwargs, *plan)


CHECKS = [check_one_rank_hybrid_under_sleeps]
rank_checks, test_check = rank_check_tests(CHECKS, world_size=1, device="cuda", timeout_s=300)
