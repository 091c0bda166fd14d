"""Every behaviour of torch's ``test_fsdp_mixed_precision.py`` as conformance checks against every
engine with torch FSDP1's API (``fsdp_api``: our engine ``builtin`` and torch FSDP1 ``torch-fsdp``), on
two gloo CPU ranks shared by both engines (and, in ``suites/mixed_precision``, by every module of the
folder). The same jobs run on two GPUs with NCCL in ``gpu``.

float16 compute works on CPU in torch 2.13 (linear, layer norm, softmax, embedding, batch norm,
conv, the transformer layers and cross entropy all have float16 CPU kernels), so the CPU tier
uses the torch test's float16 (and bfloat16 where the torch test does) rather than substituting bfloat16.

CPU offload runs as its own test id: torch FSDP1's offload pins host memory, which needs an
accelerator, so on CPU ranks those ids skip for ``torch-fsdp`` with that reason (``FSDPApi.require_offload``).

Left out, with reason: the torch test's ``use_composable=True`` variants (torch's composable
``fully_shard`` is not an FSDP1-wrapper API); SyncBatchNorm's forward and ResNet-50 (they need GPUs:
``gpu``).
"""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import _flat_param as torch_flat_param

from engine import precision as engine_precision
from harness.conformance.mixed_precision import e2e_jobs, eval_jobs, grad_jobs, module_jobs, rank_api
from harness.conformance.mixed_precision.cases import E2E_RUNS, EMBEDDING_CONFIGS
from harness.conformance.mixed_precision.pools import cpu_pair
from harness.conformance.mixed_precision.rank_api import MP_CONFIGS, assert_ok
from harness.ranks.pool import RankPool

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "cpu_pair",
    "test_mixed_precision_e2e_full_shard",
    "test_mixed_precision_no_reshard_after_forward",
    "test_mixed_precision_unsharded",
    "test_grads_reduced_precision",
    "test_mp_embedding",
    "test_mp_batchnorm",
    "test_full_prec_in_eval_variable_is_fsdp1s",
    "test_eval_root_cast_inputs",
    "test_full_precision_in_eval",
    "test_full_precision_in_eval_buffers",
    "test_full_precision_in_eval_comm",
    "test_input_grads_with_param_mixed_precision",
    "test_no_sync_mixed_precision",
    "test_mixed_precision_with_ignored_module",
    "test_submodules_with_different_precisions",
    "test_submodules_with_external_inputs",
    "test_train_ema_eval_flow",
]

OFFLOAD = pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])


@pytest.mark.parametrize("mp", list(MP_CONFIGS))
@OFFLOAD
def test_mixed_precision_e2e_full_shard(cpu_pair: RankPool, fsdp_api: str, mp: str, offload: bool) -> None:
    """FULL_SHARD, per mp config and CPU offload value: fp32/fp64 x grad scaler x forward/backward
    prefetch. Each run checks, every iteration: input, compute-weight (unsharded) and buffer dtypes
    inside forward, and the registered parameters there; the all-gather input is a low-precision
    copy of the shard (freed after the gather) exactly when param_dtype is set; the reduce-scatter
    dtype (patched collective); the scaled loss dtype; full-precision sharded parameters and
    gradients; summon_full_params in full precision with buffers in the buffer dtype; state_dict
    parameters in full precision and buffers in their original dtype."""
    payload = {"engine": fsdp_api, "mp": mp, "strategy": "FULL_SHARD", "offload": offload}
    assert assert_ok(cpu_pair.run(e2e_jobs.e2e_matrix, payload)) == [E2E_RUNS] * 2


@pytest.mark.parametrize("mp", list(MP_CONFIGS))
@OFFLOAD
def test_mixed_precision_no_reshard_after_forward(cpu_pair: RankPool, fsdp_api: str, mp: str, offload: bool) -> None:
    """SHARD_GRAD_OP (parameters stay unsharded from forward to backward), fp64 master weights."""
    payload = {"engine": fsdp_api, "mp": mp, "strategy": "SHARD_GRAD_OP", "offload": offload, "full": ["float64"],
               "scaler": [False], "prefetch": [(False, "none")]}
    assert assert_ok(cpu_pair.run(e2e_jobs.e2e_matrix, payload)) == [1, 1]


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
@OFFLOAD
def test_mixed_precision_unsharded(cpu_pair: RankPool, fsdp_api: str, strategy: str, offload: bool) -> None:
    """The torch test's world-size-1 variants (each rank in its own group, so NO_SHARD with all-reduce);
    the torch test offloads, the offload-free id keeps the behaviour covered where offload cannot run."""
    payload = {"engine": fsdp_api, "mp": "mp_diff_buffer_reduce", "strategy": strategy, "world": 1, "offload": offload,
               "full": ["float64"], "scaler": [False], "prefetch": [(False, "none")]}
    assert assert_ok(cpu_pair.run(e2e_jobs.e2e_matrix, payload)) == [1, 1]


@pytest.mark.parametrize("world", [2, 1])
@OFFLOAD
def test_grads_reduced_precision(cpu_pair: RankPool, fsdp_api: str, world: int, offload: bool) -> None:
    """keep_low_precision_grads x use_orig_params, per CPU offload value."""
    assert_ok(cpu_pair.run(grad_jobs.grads_reduced_precision, {"engine": fsdp_api, "world": world, "offload": offload}))


@pytest.mark.parametrize("config", list(EMBEDDING_CONFIGS))
def test_mp_embedding(cpu_pair: RankPool, fsdp_api: str, config: str) -> None:
    assert_ok(cpu_pair.run(grad_jobs.embedding_table, {"engine": fsdp_api, "mps": {config: EMBEDDING_CONFIGS[config]}}))


@pytest.mark.parametrize("convert_sync_bn", [False, True])
def test_mp_batchnorm(cpu_pair: RankPool, fsdp_api: str, convert_sync_bn: bool) -> None:
    """Batch norm and layer norm (``_module_classes_to_ignore``) become full-precision units with
    the warning; forward/backward run (SyncBatchNorm: wrapping only here, it computes on GPUs)."""
    payload = {"engine": fsdp_api, "convert_sync_bn": convert_sync_bn, "forward": not convert_sync_bn}
    assert_ok(cpu_pair.run(module_jobs.mp_batchnorm, payload))


def test_full_prec_in_eval_variable_is_fsdp1s() -> None:
    """Both engines read the variable the jobs set (``FSDP_USE_FULL_PREC_IN_EVAL``)."""
    assert rank_api.FULL_PREC_IN_EVAL_ENV == engine_precision.FULL_PREC_IN_EVAL_ENV
    assert rank_api.FULL_PREC_IN_EVAL_ENV == torch_flat_param._FSDP_USE_FULL_PREC_IN_EVAL


def test_eval_root_cast_inputs(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(eval_jobs.eval_root_cast_inputs, {"engine": fsdp_api}))


def test_full_precision_in_eval(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(eval_jobs.full_precision_in_eval, {"engine": fsdp_api}))


def test_full_precision_in_eval_buffers(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(eval_jobs.full_precision_in_eval_buffers, {"engine": fsdp_api}))


def test_full_precision_in_eval_comm(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(eval_jobs.full_precision_in_eval_comm, {"engine": fsdp_api}))


def test_input_grads_with_param_mixed_precision(cpu_pair: RankPool, fsdp_api: str) -> None:
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD x use_orig_params."""
    assert_ok(cpu_pair.run(grad_jobs.input_grads_with_param_mp, {"engine": fsdp_api}))


def test_no_sync_mixed_precision(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(grad_jobs.no_sync_mixed_precision, {"engine": fsdp_api}))


def test_mixed_precision_with_ignored_module(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(module_jobs.ignored_modules, {"engine": fsdp_api}))


def test_submodules_with_different_precisions(cpu_pair: RankPool, fsdp_api: str) -> None:
    """The torch test's five layouts: three work (with the recorded input dtypes), two raise."""
    values = assert_ok(cpu_pair.run(module_jobs.submodule_precision, {"engine": fsdp_api}))
    assert values[0]["low_on_c2_no_cast"] == values[0]["low_on_c1_under_f32_root"] == "raised"


def test_submodules_with_external_inputs(cpu_pair: RankPool, fsdp_api: str) -> None:
    assert_ok(cpu_pair.run(module_jobs.submodule_external_inputs, {"engine": fsdp_api}))


def test_train_ema_eval_flow(cpu_pair: RankPool, fsdp_api: str) -> None:
    """SHARD_GRAD_OP (the strategy that exposed the original bug), FULL_SHARD and NO_SHARD."""
    values = assert_ok(cpu_pair.run(eval_jobs.train_ema_eval, {"engine": fsdp_api}))
    assert sorted(values[0]) == ["FULL_SHARD", "NO_SHARD", "SHARD_GRAD_OP"]
