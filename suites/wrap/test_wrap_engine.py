"""The seed's ``test_wrap.py`` training behaviours against our engine's ``FullyShardedDataParallel``.

The structure tests (units built in this process on a process-group double) run against every
FSDP1-API engine in ``suites/seeds/test_fsdp_wrap.py``. Here the main wrap API and the auto-wrap smoke
test train in rank processes (:mod:`wrap_jobs`): on two gloo CPU ranks (one for the smoke test,
the seed's world-size-1 group) and, where there are GPUs, on NCCL with the seed's CUDA init modes
and ``device_id``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import wrap_jobs

from harness.pool import RankPool

# ---------------------------------------------------------------------------- training in rank processes
INIT_MODES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda_before", id="cuda_before", marks=pytest.mark.gpu),
    pytest.param("cuda_after", id="cuda_after", marks=pytest.mark.gpu),
]


def _pool_for(request: pytest.FixtureRequest, init_mode: str, world: int) -> RankPool:
    kind = "cpu" if init_mode == "cpu" else "gpu"
    name = f"{kind}_{'pair' if world == 2 else 'single'}"
    return request.getfixturevalue(name)


@pytest.mark.parametrize("init_mode", INIT_MODES)
@pytest.mark.parametrize(
    "offload_params, backward_prefetch, forward_prefetch",
    list(itertools.product([False, True], ["BACKWARD_POST", "BACKWARD_PRE"], [False, True])),
)
def test_main_wrap_api(
    request: pytest.FixtureRequest, offload_params: bool, backward_prefetch: str, forward_prefetch: bool, init_mode: str
) -> None:
    if init_mode == "cuda_after" and offload_params:
        pytest.skip("CPU offload with the model moved to CUDA after wrapping is unsupported (as in FSDP1)")
    pool = _pool_for(request, init_mode, world=2)
    cfg = {
        "offload_params": offload_params,
        "backward_prefetch": backward_prefetch,
        "forward_prefetch": forward_prefetch,
        "init_mode": init_mode,
    }
    outcome = pool.run(wrap_jobs.main_wrap_api, cfg)
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    for rank, result in enumerate(outcome.values):
        torch.testing.assert_close(result["losses"], result["ref_losses"], msg=lambda m: f"rank {rank}: {m}")
    assert outcome.values[0]["losses"] == outcome.values[1]["losses"]


@pytest.mark.parametrize(
    "init_mode, use_device_id",
    [
        pytest.param("cpu", False, id="cpu"),
        pytest.param("cuda_before", False, id="cuda_before", marks=pytest.mark.gpu),
        pytest.param("cuda_before", True, id="cuda_before-device_id", marks=pytest.mark.gpu),
        pytest.param("cuda_after", False, id="cuda_after", marks=pytest.mark.gpu),
        pytest.param("cuda_after", True, id="cuda_after-device_id", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("offload_params", [False, True])
def test_auto_wrap_smoke_test(
    request: pytest.FixtureRequest, init_mode: str, use_device_id: bool, offload_params: bool
) -> None:
    if init_mode == "cuda_after" and offload_params:
        pytest.skip("CPU offload with the model moved to CUDA after wrapping is unsupported (as in FSDP1)")
    pool = _pool_for(request, init_mode, world=1)
    cfg = {"init_mode": init_mode, "use_device_id": use_device_id, "offload_params": offload_params}
    outcome = pool.run(wrap_jobs.auto_wrap_smoke, cfg)
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    torch.testing.assert_close(outcome.values[0]["loss"], outcome.values[0]["ref_loss"])


@pytest.mark.parametrize("init_mode", [INIT_MODES[0], INIT_MODES[1]])
def test_mixed_precision_batchnorm_unit_runs_in_float32(request: pytest.FixtureRequest, init_mode: str) -> None:
    """Auto wrapping with mixed precision gives batch norm its own float32 unit (as FSDP1 does)."""
    pool = _pool_for(request, init_mode, world=2)
    outcome = pool.run(wrap_jobs.mixed_precision_batchnorm, {})
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    for result in outcome.values:
        assert result["units"] == ["Sequential", "Linear", "BatchNorm1d", "Linear"]
        assert result["bn_input"] == "torch.float32" and result["output"] == "torch.bfloat16"
        losses = result["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
