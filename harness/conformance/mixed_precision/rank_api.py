"""What every rank job of the mixed-precision suites shares: the engine under test by name, the torch test's
configurations by name, the collectives a block issues (``harness.compare.trace.CommTrace``), and turning a
pool outcome into values or a skip.

Rank jobs are module-level functions ``job(ctx, payload)`` (pickled by name), one module per subject
(``e2e_jobs``, ``grad_jobs``, ``module_jobs``, ``eval_jobs``, ``scaler_jobs``, ``parity_jobs``). Each
raises ``AssertionError`` naming what it found wrong and returns plain data. Payloads name the engine
under test (``payload["engine"]``: an engine with torch FSDP1's API, ``builtin`` or ``torch-fsdp``),
dtypes and configurations by string so test ids stay readable; every job runs on CPU (gloo) and on
CUDA (NCCL) alike, on the device ``ctx.device``.

The jobs are conformance checks: they use only the FSDP1 public names of
:func:`harness.conformance.fsdp1_checks.load_api` and observe what any FSDP1 engine shows (the collectives it calls
on ``torch.distributed``, dtypes seen inside forward, registered parameters, gradients, state
dicts). Where our engine and torch FSDP1 differ, each engine's own side is asserted with the reason.

A job may skip (``pytest.skip`` on every rank alike, before its first collective, e.g. torch's CPU
offload on a rank without an accelerator); :func:`assert_ok` turns that into a skip of the test.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.nn as nn

from harness.cases.case import PRECISIONS, PrecisionName
from harness.cases.dtypes import dtype_of
from harness.compare.trace import CommEvent, CommTrace, OpKind, dtypes, ops
from harness.conformance.fsdp1_checks import FSDPApi, load_api
from harness.engines.adapters import fsdp1_mixed_precision
from harness.ranks.pool import PoolOutcome
from harness.ranks.rank import RankContext

#: The torch test's mixed-precision configs by the names its test ids use, as the harness's precision names.
MP_CONFIGS: dict[str, PrecisionName] = {
    "mp_fp16": "fp16",
    "mp_only_reduce": "reduce_only",
    "mp_only_param_and_buf": "param_buffer",
    "mp_no_mp": "fp32",
    "mp_diff_buffer_reduce": "fp16_bf16buf_fp32reduce",
}
#: FSDP1's environment variable for full precision in eval, read when a unit is constructed (torch
#: FSDP1 reads ``torch.distributed.fsdp._flat_param._FSDP_USE_FULL_PREC_IN_EVAL``; our engine
#: ``engine.precision.FULL_PREC_IN_EVAL_ENV``; ``mixed_precision`` checks both names agree).
FULL_PREC_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"


def engine_api(payload: dict[str, Any]) -> FSDPApi:
    """The FSDP1 API of the engine the payload names (``payload["engine"]``, the ``fsdp_api`` fixture)."""
    if "engine" not in payload:
        raise KeyError("payload['engine'] must name the engine under test (its spec): pass the fsdp_api fixture")
    return load_api(payload["engine"])


def grad_scaler_class(engine: str) -> type:
    """The ``ShardedGradScaler`` class of the engine ``engine`` (a spec) names (``FSDPApi.ShardedGradScaler``)."""
    api = load_api(engine)
    if api.ShardedGradScaler is None:
        raise ValueError(
            f"engine {api.name!r}: {api.module} exports no ShardedGradScaler (package level or .sharded_grad_scaler)"
        )
    return api.ShardedGradScaler


def strategy(api: FSDPApi, name: str) -> Any:
    return getattr(api.ShardingStrategy, name)


def make_mp(api: FSDPApi, name: str) -> Any:
    """The ``MixedPrecision`` of the torch test's config ``name`` (``MP_CONFIGS``)."""
    return fsdp1_mixed_precision(api, PRECISIONS[MP_CONFIGS[name]])


def device_kwargs(ctx: RankContext) -> dict[str, Any]:
    """``device_id`` on GPUs, as the torch test passes it; on CPU ``FSDPApi.wrap`` adds what the engine needs."""
    return {"device_id": ctx.device} if ctx.device.type == "cuda" else {}


def assert_ok(outcome: PoolOutcome) -> list[Any]:
    """The per-rank values of a job that must have succeeded on every rank (else every traceback).

    A job that skipped itself on every rank (``pytest.skip`` raised before any collective) skips
    the calling test with the ranks' reason; a skip on some ranks only is a failure.
    """
    skipped = [e for e in outcome.errors.values() if e.type == "Skipped"]
    if outcome.status == "error" and skipped and len(skipped) == len(outcome.values):
        from harness.pytest_plugin import skip_here  # the test process only

        skip_here(" | ".join(sorted({e.message for e in skipped})))
    if outcome.status != "ok":
        details = "\n".join(e.traceback for e in outcome.errors.values())
        raise AssertionError(f"{outcome.status}: {outcome.reason}\n{details}")
    return outcome.values


@contextlib.contextmanager
def full_prec_in_eval(enabled: bool) -> Iterator[None]:
    """``FSDP_USE_FULL_PREC_IN_EVAL`` for the models constructed inside (read at construction)."""
    previous = os.environ.get(FULL_PREC_IN_EVAL_ENV)
    os.environ[FULL_PREC_IN_EVAL_ENV] = "1" if enabled else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FULL_PREC_IN_EVAL_ENV, None)
        else:
            os.environ[FULL_PREC_IN_EVAL_ENV] = previous


#: keyword names of a collective's input tensor, per ``torch.distributed`` signature.

@contextlib.contextmanager
def recorded(kind: OpKind) -> Iterator[list[CommEvent]]:
    """The collectives of ``kind`` the block issues, one-rank groups included, each all-gather with its
    local shard (``harness.compare.trace.CommTrace(keep_inputs=True)``); the list fills when the block ends."""
    calls: list[CommEvent] = []
    with CommTrace(keep_inputs=True) as trace:
        yield calls
    calls.extend(ops(trace.events, op=kind, min_group=1))


def reduced_dtypes(calls: list[CommEvent]) -> set[torch.dtype]:
    """The dtypes ``calls`` carried."""
    return {dtype_of(d) for d in dtypes(calls)}


def check_buffers(model: nn.Module, expected: torch.dtype, when: str) -> None:
    """Every buffer of ``model`` is in ``expected`` (``when`` names the moment in the message)."""
    for name, buf in model.named_buffers():
        assert buf.dtype == expected, f"{when}: buffer {name} is {buf.dtype}, expected {expected}"
