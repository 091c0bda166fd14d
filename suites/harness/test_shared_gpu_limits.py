"""What gloo on CUDA tensors cannot do where ranks share a GPU, each checked to still hold: a limit that
goes away (a torch upgrade) fails here, and the rule that works around it can go.

- torch FSDP1 with CPU offload: its all-gather into the unsharded flat parameter raises in gloo's
  worker thread (``torch-fsdp``'s adapter declares such cases unsupported on shared GPUs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness.rank import rank_device
from suites.engine.ranks import session_tests

pytestmark = pytest.mark.gpu


def _on_shared_gloo_gpu() -> None:
    if rank_device().type != "cuda" or dist.get_backend() != "gloo":
        pytest.skip(reason="a limit of gloo with CUDA tensors; these ranks run NCCL with a GPU each")


def check_torch_fsdp1_offload_all_gather_fails_on_gloo_cuda(rank: int, world_size: int) -> None:
    _on_shared_gloo_gpu()
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Linear(8, 8), cpu_offload=CPUOffload(offload_params=True),
                                     device_id=rank_device())
    with pytest.raises(RuntimeError, match="SplitBackward0 is a view and is being modified inplace"):
        model(torch.randn(4, 8, device=rank_device())).sum().backward()
    # Without offload the same module trains.
    plain = FullyShardedDataParallel(nn.Linear(8, 8), device_id=rank_device())
    plain(torch.randn(4, 8, device=rank_device())).sum().backward()


CHECKS = [check_torch_fsdp1_offload_all_gather_fails_on_gloo_cuda]

session, test_check = session_tests(CHECKS, world_size=2, device="cuda", timeout_s=120)
