"""The DDP reference's own values where ranks share a GPU: DDP's reducer over gloo with CUDA tensors
once averaged gradients wrongly without an error (fixed upstream in December 2025), and every DDP
comparison of a shared-GPU run trusts it. Each rank's gradient is checked against the all-reduced
average of every rank's plain local gradient, bucket by bucket (several buckets, an unused parameter,
``no_sync`` accumulation), on CPU ranks and on ranks on the GPUs."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.ranks.rank import rank_device


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)


def _expected_grads(model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The average over ranks of the sum of this rank's per-batch gradients, with plain collectives."""
    plain = _model(next(model.parameters()).device)
    for x in batches:
        plain(x).square().mean().backward()
    grads = [p.grad.detach().clone() for p in plain.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def check_ddp_averages_like_plain_collectives(rank: int, world_size: int) -> None:
    device = rank_device()
    torch.manual_seed(100 + rank)
    batches = [torch.randn(16, 32, device=device) for _ in range(3)]
    # Small buckets: several reductions in flight, the case the broken reducer got wrong.
    ddp = DistributedDataParallel(_model(device), device_ids=[device] if device.type == "cuda" else None,
                                  bucket_cap_mb=0.01)
    with ddp.no_sync():
        for x in batches[:-1]:
            ddp(x).square().mean().backward()
    ddp(batches[-1]).square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    for (name, p), want in zip(ddp.module.named_parameters(), _expected_grads(ddp.module, batches)):
        assert_close(p.grad, want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"DDP gradient of {name} on {device}: {m}")


CHECKS = [check_ddp_averages_like_plain_collectives]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2, device=("cpu", "cuda"), timeout_s=120)
