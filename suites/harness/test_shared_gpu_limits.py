"""What gloo on CUDA tensors cannot do where ranks share a GPU, each checked to still hold: a limit that
goes away (a torch upgrade) fails here, and the rule that works around it can go.

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


def _on_shared_gloo_gpu() -> None:
    if rank_device().type != "cuda" or dist.get_backend() != "gloo":
        pytest.skip(reason="a limit of gloo with CUDA tensors; these ranks run NCCL with a GPU each")


def check_torch_fsdp1_offloaded_summon_breaks_the_next_all_gather(rank: int, world_size: int) -> None:
    _on_shared_gloo_gpu()
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

    def model() -> nn.Module:
        torch.manual_seed(0)
        return FullyShardedDataParallel(nn.Linear(8, 8), cpu_offload=CPUOffload(offload_params=True),
                                        device_id=rank_device())

    def step(m: nn.Module) -> None:
        m(torch.randn(4, 8, device=rank_device())).sum().backward()

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


CHECKS = [check_torch_fsdp1_offloaded_summon_breaks_the_next_all_gather]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2, device="cuda", timeout_s=120)
