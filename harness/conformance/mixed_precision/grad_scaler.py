"""``ShardedGradScaler`` of every engine with torch FSDP1's API (``fsdp_api``: ``engine.ShardedGradScaler``
and ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``): every rank agrees to skip a
step when any rank's shard has an inf/nan, with CPU offload, float16 and bfloat16 gradients; and
``scale`` keeps the loss dtype.

Each multi-rank case runs three steps: clean, an inf injected into rank 1's gradient shard only,
clean again. torch's plain ``GradScaler`` runs the same scenario for contrast: it lets rank 0
step while rank 1 skips (the replicas diverge), so the check that the sharded scaler agrees is a
check that can fail. Offload cases skip for ``torch-fsdp`` on CPU ranks (its offload pins memory,
which needs an accelerator).
"""

from __future__ import annotations

import pytest
import torch

from harness.conformance.mixed_precision import scaler_jobs
from harness.conformance.mixed_precision.cases import SCALER_CASES, check_scaler_agreement
from harness.conformance.mixed_precision.pools import cpu_pair
from harness.conformance.mixed_precision.rank_api import assert_ok, grad_scaler_class
from harness.ranks.pool import RankPool

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "cpu_pair",
    "test_all_ranks_skip_together",
    "test_plain_grad_scaler_disagrees",
    "test_scale_keeps_dtype",
    "test_disabled_scaler_is_identity",
    "test_scale_rejects_non_tensors",
]


@pytest.mark.parametrize("case", list(SCALER_CASES))
def test_all_ranks_skip_together(cpu_pair: RankPool, fsdp_api: str, case: str) -> None:
    outcome = cpu_pair.run(scaler_jobs.grad_scaler_agreement, {"engine": fsdp_api, **SCALER_CASES[case]})
    check_scaler_agreement(assert_ok(outcome), case)


def test_plain_grad_scaler_disagrees(cpu_pair: RankPool, fsdp_api: str) -> None:
    """The contrast: torch's GradScaler sees only local gradients, so only rank 1 skips."""
    values = assert_ok(cpu_pair.run(scaler_jobs.grad_scaler_agreement, {"engine": fsdp_api, "scaler": "plain"}))
    assert values[0]["step1"]["stepped"] and not values[1]["step1"]["stepped"], values


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_scale_keeps_dtype(fsdp_api: str, dtype: torch.dtype) -> None:
    scaler = grad_scaler_class(fsdp_api)(device="cpu", init_scale=4.0)
    loss = torch.tensor(1.5, dtype=dtype)
    scaled = scaler.scale(loss)
    assert scaled.dtype == dtype and scaled.item() == 6.0
    pair = scaler.scale([loss, (loss * 2,)])
    assert isinstance(pair, list) and isinstance(pair[1], tuple)
    assert pair[0].dtype == dtype and pair[1][0].item() == 12.0


def test_disabled_scaler_is_identity(fsdp_api: str) -> None:
    scaler = grad_scaler_class(fsdp_api)(device="cpu", enabled=False)
    loss = torch.tensor(2.0, dtype=torch.float16)
    assert scaler.scale(loss) is loss


def test_scale_rejects_non_tensors(fsdp_api: str) -> None:
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        grad_scaler_class(fsdp_api)(device="cpu").scale([1.0, 2.0])
