"""The torch test's end-to-end mixed-precision product as rank jobs: dtypes inside forward, the all-gathered
shard copies and their release, reduction dtypes, buffers, summoning and state dicts, per strategy,
CPU offload, grad scaler and prefetch setting."""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.case import reduce_dtype_default
from harness.cases.dtypes import dtype_of
from harness.compare.trace import CommEvent
from harness.conformance.fsdp1_checks import FSDPApi, clean
from harness.conformance.mixed_precision.cases import ALL_PREFETCH
from harness.conformance.mixed_precision.models import BUFFER_ORIG_DTYPE, Expectation, PrecisionProbe
from harness.conformance.mixed_precision.rank_api import (
    check_buffers,
    device_kwargs,
    engine_api,
    grad_scaler_class,
    make_mp,
    recorded,
    reduced_dtypes,
    strategy,
)
from harness.engines.adapters import fsdp1_prefetch
from harness.ranks.rank import RankContext


def _probe_models(api: FSDPApi, full: torch.dtype, device: torch.device, kwargs: dict[str, Any]) -> Iterator[nn.Module]:
    """The torch test's simple model (one probe) and nested model (a probe unit inside a root with a probe)."""
    torch.manual_seed(0)
    yield api.wrap(PrecisionProbe(full).to(device), **kwargs)
    torch.manual_seed(0)
    inner = api.wrap(PrecisionProbe(full, buffer_name="buffer0").to(device), **kwargs)
    yield api.wrap(nn.Sequential(inner, PrecisionProbe(full, buffer_name="buffer1").to(device)), **kwargs)


def _storage_ptrs(model: nn.Module) -> set[int]:
    """Storage of the registered (sharded) parameters, taken while every unit is at rest."""
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _check_gathers(
    calls: list[CommEvent], shard_ptrs: set[int], expect_param: torch.dtype, must_copy: bool
) -> list[weakref.ref]:
    """Each all-gather input (the local shard) is in the compute dtype, and is a separate copy of the
    registered shard exactly when it must be (parameter mixed precision, or a device move). Returns
    weak references to the copies, which the caller checks are freed (:func:`_assert_released`)."""
    copies = []
    for call in calls:
        shard = call.local
        assert shard is not None, f"{call.name} has no input tensor to check"
        assert shard.dtype == expect_param, f"{call.name} input in {shard.dtype}, expected {expect_param}"
        copied = shard.storage_ptr not in shard_ptrs
        assert copied == must_copy, f"{call.name} input copied={copied} but expected {must_copy}"
        if copied:
            copies.append(shard.storage)
    return copies


def _freed(ref: weakref.ref) -> bool:
    """The storage is gone (our engine drops its shard copy) or resized to nothing (torch FSDP1 keeps
    its low-precision shard tensor and frees the storage under it, as the torch test checks)."""
    storage = ref()
    return storage is None or storage.nbytes() == 0


def _assert_released(refs: list[weakref.ref], timeout_s: float = 10.0) -> None:
    """The memory behind every ``refs`` is freed within ``timeout_s``. The engine frees its shard copy
    when the gather returns; the backend's work object may hold the input a little longer (gloo's
    worker thread, NCCL's watchdog) until it observes completion."""
    deadline = time.monotonic() + timeout_s
    while not all(_freed(r) for r in refs):
        if time.monotonic() > deadline:
            alive = [r().nbytes() for r in refs if not _freed(r)]
            raise AssertionError(
                f"{len(alive)} low-precision shard copies still allocated after their all-gathers (bytes: {alive})"
            )
        time.sleep(0.001)


def _check_state_dict(api: FSDPApi, model: nn.Module, full: torch.dtype, summoned: list[str]) -> None:
    """Parameters are checkpointed in full precision, buffers in their original dtype (both engines),
    under the clean names of the default ``FULL_STATE_DICT``."""
    raw_buffers = [n for n, _ in model.named_buffers()]
    buffers = {clean(n) for n in raw_buffers}
    sd = model.state_dict()
    for key, t in sd.items():
        want = BUFFER_ORIG_DTYPE if clean(key) in buffers else full
        assert t.dtype == want, f"state_dict[{key}] is {t.dtype}, expected {want}"
    want_keys = set(summoned) | buffers
    assert set(sd) == want_keys, f"{api.name}: state_dict keys {sorted(sd)}, expected {sorted(want_keys)}"


def _run_e2e(
    api: FSDPApi,
    ctx: RankContext,
    mp: Any,
    sharding: Any,
    offload: bool,
    full: torch.dtype,
    use_scaler: bool,
    backward_prefetch: Any,
    forward_prefetch: bool,
    group: dist.ProcessGroup,
) -> None:
    device = ctx.device
    expect_param = mp.param_dtype or full
    expect_buffer = mp.buffer_dtype or BUFFER_ORIG_DTYPE
    expect_reduce = reduce_dtype_default(full, mp.param_dtype, mp.reduce_dtype)
    sharded = group.size() > 1 and sharding != api.ShardingStrategy.NO_SHARD
    reduce_op = "reduce_scatter" if sharded else "all_reduce"
    # The gathered shard is a copy of the registered one when it is cast or moved to the device.
    must_copy = mp.param_dtype is not None or (offload and device.type != "cpu")
    kwargs = dict(
        process_group=group,
        sharding_strategy=sharding,
        cpu_offload=api.CPUOffload(offload_params=offload),
        mixed_precision=mp,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        **device_kwargs(ctx),
    )
    # On CPU the copies are checked after each gather; on GPUs, where NCCL's watchdog releases a
    # finished work's inputs up to a polling interval later, once per model.
    check_now = device.type == "cpu"
    scaler_cls = grad_scaler_class(api.name)
    for model in _probe_models(api, full, device, kwargs):
        copies: list[weakref.ref] = []

        def released(refs: list[weakref.ref]) -> None:
            if check_now:
                _assert_released(refs)
            else:
                copies.extend(refs)

        scaler = scaler_cls(device=device.type, enabled=use_scaler, process_group=group)
        optim = torch.optim.Adam(model.parameters())
        for _ in range(3):
            shard_ptrs = _storage_ptrs(model)
            expect = Expectation(
                expect_param, expect_buffer, full, root=model,
                rest_numels=tuple(p.numel() for p in model.parameters()),
                swaps_registered=api.is_torch, expect_active_unit=sharded,
            )
            inp = torch.randn(3, 10, device=device, dtype=full)
            with recorded("all_gather") as gathers:
                act, _ = model((inp, expect))
            check_buffers(model, expect_buffer, "after forward")
            if sharded:
                released(_check_gathers(gathers, shard_ptrs, expect_param, must_copy))
            loss = scaler.scale(act.sum())
            assert loss.dtype == expect_param, f"scaled loss is {loss.dtype}, expected {expect_param}"
            with recorded(reduce_op) as reductions, recorded("all_gather") as gathers:
                loss.backward()
            assert reductions, f"no {reduce_op} in backward"
            assert reduced_dtypes(reductions) == {expect_reduce}, f"reduced in {reduced_dtypes(reductions)}, expected {expect_reduce}"
            if sharded:
                released(_check_gathers(gathers, shard_ptrs, expect_param, must_copy))
            check_buffers(model, expect_buffer, "after backward")
            for name, p in model.named_parameters():
                assert p.dtype == full, f"{name} is {p.dtype} after backward, expected {full}"
                assert p.grad is None or p.grad.dtype == full, f"{name}.grad is {p.grad.dtype}, expected {full}"
            scaler.step(optim)
            scaler.update()
            with recorded("all_gather") as gathers, api.FSDP.summon_full_params(model):
                summoned = []
                for name, p in model.named_parameters():
                    assert p.dtype == full, f"summoned {name} is {p.dtype}"
                    summoned.append(name)
                # Buffers are cast once and restored only in state_dict, not by summoning.
                check_buffers(model, expect_buffer, "inside summon_full_params")
            if sharded:
                # Summoning gathers the full-precision shard itself: no low-precision copy.
                released(_check_gathers(gathers, shard_ptrs, full, offload and device.type != "cpu"))
            _check_state_dict(api, model, full, summoned)
            check_buffers(model, expect_buffer, "after state_dict")
        _assert_released(copies)


def e2e_matrix(ctx: RankContext, payload: dict[str, Any]) -> int:
    """The torch test's ``test_mixed_precision_e2e_full_shard`` product for one mp config and one CPU
    offload value: full precision (fp32, fp64) x grad scaler x prefetch settings. Returns the
    number of configurations run."""
    api = engine_api(payload)
    offload = payload.get("offload", False)
    api.require_offload(offload)  # before any collective, on every rank alike
    mp = make_mp(api, payload["mp"])
    group = ctx.world_group() if payload.get("world", 2) == 2 else ctx.singleton_group()
    combos = itertools.product(
        payload.get("full", ["float32", "float64"]),
        payload.get("scaler", [False, True]),
        payload.get("prefetch", ALL_PREFETCH),
    )
    count = 0
    for full, scaler, (fwd, bwd) in combos:
        sharding = strategy(api, payload["strategy"])
        _run_e2e(api, ctx, mp, sharding, offload, dtype_of(full), scaler, fsdp1_prefetch(api, bwd), fwd, group)
        count += 1
    return count
