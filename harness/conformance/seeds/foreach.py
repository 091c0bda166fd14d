"""The ported test_multi_tensor_apply_size0_tensors: torch's foreach kernels (what optimizers and gradient
clipping run over many shards) accept empty tensors, as a rank's padding-only shard is, on CPU and CUDA.
No engine is involved: it checks the torch the engines run on."""

from __future__ import annotations

import pytest
import torch

from harness.pytest_plugin import needs_gpus

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["test_foreach_kernels_take_empty_tensors"]

#: the ported test's count: a list long enough to have crashed torch's multi-tensor apply on empty tensors (its
#: "large enough to trigger stack corruption"); the kernels walk the list in several launches.
NUM_SIZE0_TENSORS = 1000


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpus(1)])])
def test_foreach_kernels_take_empty_tensors(device: str) -> None:
    size0 = [torch.empty(0, device=device) for _ in range(NUM_SIZE0_TENSORS)]
    torch._foreach_mul_(size0, 0.1)
    assert all(t.numel() == 0 and t.device.type == device for t in size0)
    assert torch.stack(torch._foreach_norm(size0)).eq(0).all()
    empty = torch.nn.Parameter(torch.empty(0, device=device))
    empty.grad = torch.empty(0, device=device)
    assert float(torch.nn.utils.clip_grad_norm_([empty], 1.0, foreach=True)) == 0.0
