"""Torch's ``test_wrap.py`` training behaviours, as conformance tests run against every engine with
torch FSDP1's API (``fsdp_api``: our engine ``builtin`` and torch FSDP1 ``torch-fsdp``; ``--engine``
restricts them).

The structure tests (units built in this process on a process-group double) run against the same
engines in ``harness.conformance.seeds.fsdp_wrap``. Here the main wrap API, the auto-wrap smoke test and a
mixed-precision run with batch norm train in rank processes (:mod:`harness.conformance.wrap.wrap_jobs`, which load the engine
by name on the rank): on two gloo CPU ranks (one for the smoke test, the torch test's world-size-1 group)
and, where there are GPUs, on NCCL with the torch test's CUDA init modes and ``device_id``. Both engines
share the pools below (module-scoped; each job loads its engine by name on the rank).

Skips (decided here, in the test process, before any rank starts a collective, so every rank agrees):

- torch FSDP1 with ``offload_params=True`` on the CPU tier: it pins the host memory of offloaded shards,
  which needs an accelerator (``FSDPApi.require_offload``), and even where pinning works, its
  post-backward callback synchronizes the compute device's current stream, which ``torch.cpu.Stream``
  cannot (``AttributeError: 'Stream' object has no attribute 'synchronize'``). Our engine offloads on
  the CPU tier; on GPUs both engines offload.
- CPU offload with the module moved to CUDA after wrapping, on both engines, as the torch test does (FSDP1
  requires offloaded flat parameters to stay on the CPU).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.conformance.fsdp1_checks import FSDPApi, api
from harness.conformance.wrap import wrap_jobs
from harness.pytest_plugin.pools import rank_pool_fixture
from harness.ranks.pool import PoolOutcome, RankPool

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "api",
    "cpu_pair",
    "cpu_single",
    "gpu_pair",
    "gpu_single",
    "test_main_wrap_api",
    "test_auto_wrap_smoke_test",
    "test_mixed_precision_batchnorm_unit_runs_in_float32",
]

#: the torch tests this suite ports run their multi-rank tests on two ranks, on the GPUs (NCCL with one
#: GPU per rank, or gloo ranks sharing one: ``harness.ranks.placement.place``) or on two gloo CPU ranks.
GPU_WORLD = 2


cpu_pair = rank_pool_fixture(2, "cpu", timeout_s=120.0, doc="Two gloo ranks on CPU, started once for the module.")
cpu_single = rank_pool_fixture(1, "cpu", timeout_s=120.0, doc="One gloo rank on CPU: the torch test's world-size-1 default group.")
gpu_pair = rank_pool_fixture(GPU_WORLD, "cuda", timeout_s=120.0, doc="Two ranks on this worker's GPUs (one each, or sharing one).")
gpu_single = rank_pool_fixture(1, "cuda", timeout_s=120.0, doc="One rank on this worker's first GPU.")

INIT_MODES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda_before", id="cuda_before", marks=pytest.mark.gpu),
    pytest.param("cuda_after", id="cuda_after", marks=pytest.mark.gpu),
]


def _pool_for(request: pytest.FixtureRequest, init_mode: str, world: int) -> RankPool:
    kind = "cpu" if init_mode == "cpu" else "gpu"
    name = f"{kind}_{'pair' if world == 2 else 'single'}"
    return request.getfixturevalue(name)


#: why each engine skips CPU offload where it does (see the module docstring).
CUDA_AFTER_OFFLOAD = (
    "CPU offload with the model moved to CUDA after wrapping is unsupported (the torch test skips it: FSDP1 requires "
    "offloaded flat parameters to stay on the CPU)"
)
TORCH_CPU_OFFLOAD = (
    "torch-fsdp: CPU offload with a CPU compute device (device_id=cpu) is unsupported on any host: FSDP1's "
    "post-backward callback calls current_stream().synchronize(), which torch.cpu.Stream lacks"
)


def _require_offload_supported(api: FSDPApi, offload_params: bool, init_mode: str) -> None:
    """Skip the combinations that cannot run, before any rank starts a collective."""
    if init_mode == "cuda_after" and offload_params:
        pytest.skip(reason=CUDA_AFTER_OFFLOAD)
    api.require_offload(offload_params)
    if offload_params and api.is_torch and init_mode == "cpu":
        # Measured with pinning stubbed out: torch then fails at the end of the first backward.
        pytest.skip(reason=TORCH_CPU_OFFLOAD)


def _values(outcome: PoolOutcome) -> list:
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    return outcome.values


@pytest.mark.parametrize("init_mode", INIT_MODES)
@pytest.mark.parametrize(
    "offload_params, backward_prefetch, forward_prefetch",
    list(itertools.product([False, True], ["BACKWARD_POST", "BACKWARD_PRE"], [False, True])),
)
def test_main_wrap_api(
    request: pytest.FixtureRequest,
    api: FSDPApi,
    offload_params: bool,
    backward_prefetch: str,
    forward_prefetch: bool,
    init_mode: str,
) -> None:
    """Every module its own unit with the root's settings; six steps match the harness's local reference."""
    _require_offload_supported(api, offload_params, init_mode)
    pool = _pool_for(request, init_mode, world=2)
    cfg = {
        "engine": api.name,
        "offload_params": offload_params,
        "backward_prefetch": backward_prefetch,
        "forward_prefetch": forward_prefetch,
        "init_mode": init_mode,
    }
    _values(pool.run(wrap_jobs.main_wrap_api, cfg))


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
    request: pytest.FixtureRequest, api: FSDPApi, init_mode: str, use_device_id: bool, offload_params: bool
) -> None:
    """Size-based auto wrap on a one-rank group: the torch test's layout, then a forward and backward."""
    _require_offload_supported(api, offload_params, init_mode)
    pool = _pool_for(request, init_mode, world=1)
    cfg = {"engine": api.name, "init_mode": init_mode, "use_device_id": use_device_id, "offload_params": offload_params}
    (result,) = _values(pool.run(wrap_jobs.auto_wrap_smoke, cfg))
    torch.testing.assert_close(result["loss"], result["ref_loss"], msg=lambda m: f"{api.name}: {m}")


@pytest.mark.parametrize("init_mode", [INIT_MODES[0], INIT_MODES[1]])
def test_mixed_precision_batchnorm_unit_runs_in_float32(
    request: pytest.FixtureRequest, api: FSDPApi, init_mode: str
) -> None:
    """Auto wrapping with mixed precision gives batch norm its own float32 unit (as FSDP1 does)."""
    pool = _pool_for(request, init_mode, world=2)
    for result in _values(pool.run(wrap_jobs.mixed_precision_batchnorm, {"engine": api.name})):
        assert result["units"] == ["Sequential", "Linear", "BatchNorm1d", "Linear"], api.name
        assert (result["bn_input"], result["output"]) == ("torch.float32", "torch.bfloat16"), api.name
        losses = result["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], (api.name, losses)
