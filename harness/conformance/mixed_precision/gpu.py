"""The mixed-precision suites on two GPUs with NCCL, for every engine with torch FSDP1's API
(``fsdp_api``): every CPU job again (float16 as in the torch test, CPU offload for both engines: torch
FSDP1 can pin memory here), plus what needs CUDA: SyncBatchNorm's forward and ResNet-50 with
size-based wrapping.

Run on a machine with 2 GPUs (about a minute per engine on two H200s)::

    python -m pytest suites/mixed_precision -m gpu -q
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.cases.case import PRECISIONS
from harness.collect.expectations import expected_failure
from harness.compare.parity import record_from_outcome
from harness.conformance.mixed_precision import e2e_jobs, eval_jobs, grad_jobs, module_jobs, parity_jobs, scaler_jobs
from harness.conformance.mixed_precision.cases import (
    E2E_RUNS,
    EMBEDDING_CONFIGS,
    SCALER_CASES,
    TORCH_FSDP1_CUDA_SCALER_FAILURES,
    check_parity_records,
    check_scaler_agreement,
    parity_cases,
)
from harness.conformance.mixed_precision.pools import gpu_pair
from harness.conformance.mixed_precision.rank_api import MP_CONFIGS, assert_ok
from harness.pytest_plugin import expect_failure, needs_gpus
from harness.ranks.pool import RankPool

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "gpu_pair",
    "test_e2e_full_shard",
    "test_e2e_no_reshard_after_forward",
    "test_e2e_unsharded",
    "test_mp_batchnorm",
    "test_mixed_precision_resnet",
    "test_mp_embedding",
    "test_job",
    "test_sharded_grad_scaler",
    "test_parity_with_emulating_reference",
    "pytestmark",
]

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(1),
]

OFFLOAD = pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])


@pytest.mark.parametrize("mp", list(MP_CONFIGS))
@OFFLOAD
def test_e2e_full_shard(gpu_pair: RankPool, fsdp_api: str, mp: str, offload: bool) -> None:
    payload = {"engine": fsdp_api, "mp": mp, "strategy": "FULL_SHARD", "offload": offload}
    assert assert_ok(gpu_pair.run(e2e_jobs.e2e_matrix, payload)) == [E2E_RUNS] * 2


@pytest.mark.parametrize("mp", list(MP_CONFIGS))
@OFFLOAD
def test_e2e_no_reshard_after_forward(gpu_pair: RankPool, fsdp_api: str, mp: str, offload: bool) -> None:
    payload = {"engine": fsdp_api, "mp": mp, "strategy": "SHARD_GRAD_OP", "offload": offload, "full": ["float64"],
               "scaler": [False], "prefetch": [(False, "none")]}
    assert assert_ok(gpu_pair.run(e2e_jobs.e2e_matrix, payload)) == [1, 1]


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_e2e_unsharded(gpu_pair: RankPool, fsdp_api: str, strategy: str) -> None:
    payload = {"engine": fsdp_api, "mp": "mp_diff_buffer_reduce", "strategy": strategy, "world": 1, "offload": True,
               "full": ["float64"], "scaler": [False], "prefetch": [(False, "none")]}
    assert assert_ok(gpu_pair.run(e2e_jobs.e2e_matrix, payload)) == [1, 1]


@pytest.mark.parametrize("convert_sync_bn", [False, True])
def test_mp_batchnorm(gpu_pair: RankPool, fsdp_api: str, convert_sync_bn: bool) -> None:
    assert_ok(gpu_pair.run(module_jobs.mp_batchnorm, {"engine": fsdp_api, "convert_sync_bn": convert_sync_bn}))


def test_mixed_precision_resnet(gpu_pair: RankPool, fsdp_api: str) -> None:
    pytest.importorskip("torchvision", reason="ResNet-50 comes from torchvision, which is not installed")
    values = assert_ok(gpu_pair.run(module_jobs.resnet50, {"engine": fsdp_api, "size": 1000}))
    assert values[0] == values[1] == 53  # ResNet-50's batch norms, each its own unit


@pytest.mark.parametrize("config", list(EMBEDDING_CONFIGS))
def test_mp_embedding(gpu_pair: RankPool, fsdp_api: str, config: str) -> None:
    assert_ok(gpu_pair.run(grad_jobs.embedding_table, {"engine": fsdp_api, "mps": {config: EMBEDDING_CONFIGS[config]}}))


SIMPLE_JOBS = [
    (grad_jobs.grads_reduced_precision, {"world": 2, "offload": False}),
    (grad_jobs.grads_reduced_precision, {"world": 2, "offload": True}),
    (grad_jobs.grads_reduced_precision, {"world": 1, "offload": False}),
    (grad_jobs.grads_reduced_precision, {"world": 1, "offload": True}),
    (eval_jobs.eval_root_cast_inputs, {}),
    (eval_jobs.full_precision_in_eval, {}),
    (eval_jobs.full_precision_in_eval_buffers, {}),
    (eval_jobs.full_precision_in_eval_comm, {}),
    (grad_jobs.input_grads_with_param_mp, {}),
    (grad_jobs.no_sync_mixed_precision, {}),
    (module_jobs.ignored_modules, {}),
    (module_jobs.submodule_precision, {}),
    (module_jobs.submodule_external_inputs, {}),
    (eval_jobs.train_ema_eval, {"d_model": 64}),
]


@pytest.mark.parametrize("job,job_payload", SIMPLE_JOBS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_job(gpu_pair: RankPool, fsdp_api: str, job: Any, job_payload: dict[str, Any]) -> None:
    assert_ok(gpu_pair.run(job, {"engine": fsdp_api, **job_payload}))


@pytest.mark.parametrize("case", list(SCALER_CASES))
def test_sharded_grad_scaler(request: pytest.FixtureRequest, gpu_pair: RankPool, fsdp_api: str, case: str) -> None:
    if expected := expected_failure(TORCH_FSDP1_CUDA_SCALER_FAILURES, "cuda", engine=fsdp_api, check=case):
        request.applymarker(expect_failure(expected))
    outcome = gpu_pair.run(scaler_jobs.grad_scaler_agreement, {"engine": fsdp_api, **SCALER_CASES[case]})
    check_scaler_agreement(assert_ok(outcome), case)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@OFFLOAD
def test_parity_with_emulating_reference(
    gpu_pair: RankPool, fsdp_api: str, precision: str, offload: bool, record_property: Any
) -> None:
    results = [
        (dropped, record_from_outcome(case, gpu_pair.run(parity_jobs.run_parity_case, case)))
        for dropped, case in parity_cases(fsdp_api, precision, offload)
    ]
    if all(r.verdict == "unsupported" for _, r in results):
        pytest.skip(reason=results[0][1].reason)
    check_parity_records(fsdp_api, precision, results, record_property)
