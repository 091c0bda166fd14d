"""What gloo on CUDA tensors cannot do, each checked to still hold: a limit that goes away (a torch upgrade)
fails here, and the rule that works around it can go. The checks run over a gloo group of their own, so ranks
with a GPU each (NCCL pools) check the same limits as ranks sharing a GPU.

- torch FSDP1 with CPU offload: after ``summon_full_params(offload_to_cpu=True)`` its next all-gather
  into the unsharded flat parameter raises in gloo's worker thread (``torch-fsdp``'s adapter leaves that
  summon out of the offload placement probe where ranks share a GPU, with this reason).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.ranks.rank import rank_device

pytestmark = pytest.mark.gpu


def check_torch_fsdp1_offloaded_summon_breaks_the_next_all_gather(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

    group = dist.new_group(backend="gloo")

    def model() -> nn.Module:
        torch.manual_seed(0)
        return FullyShardedDataParallel(nn.Linear(8, 8), cpu_offload=CPUOffload(offload_params=True),
                                        device_id=rank_device(), process_group=group)

    def step(m: nn.Module) -> None:
        m(torch.randn(4, 8, device=rank_device())).sum().backward()

    try:
        plain = model()
        step(plain)  # offload alone trains on gloo with CUDA tensors
        with FullyShardedDataParallel.summon_full_params(plain, writeback=True):
            pass
        step(plain)  # and so after a summon that keeps the parameters on the GPU
        summoned = model()
        step(summoned)
        with FullyShardedDataParallel.summon_full_params(summoned, writeback=False, offload_to_cpu=True):
            pass
        with pytest.raises(RuntimeError, match="SplitBackward0 is a view and is being modified inplace"):
            step(summoned)
    finally:
        dist.destroy_process_group(group)


CHECKS = [check_torch_fsdp1_offloaded_summon_breaks_the_next_all_gather]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2, device="cuda", timeout_s=120)
