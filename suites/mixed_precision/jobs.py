"""Rank-side jobs of the mixed-precision suites, run by :class:`harness.pool.RankPool`.

Module-level functions ``job(ctx, payload)`` (pickled by name). Each raises ``AssertionError``
naming what it found wrong and returns plain data. Payloads name the engine under test
(``payload["engine"]``: an engine with torch FSDP1's API, ``builtin`` or ``torch-fsdp``), dtypes and
configurations by string so test ids stay readable; every job runs on CPU (gloo) and on CUDA (NCCL)
alike, on the device ``ctx.device``.

The jobs are conformance checks: they use only the FSDP1 public names of
:func:`suites.seeds.api.load_api` and observe what any FSDP1 engine shows (the collectives it calls
on ``torch.distributed``, dtypes seen inside forward, registered parameters, gradients, state
dicts). Where our engine and torch FSDP1 differ, each engine's own side is asserted with the reason.

A job may skip (``pytest.skip`` on every rank alike, before its first collective, e.g. torch's CPU
offload on a rank without an accelerator); :func:`assert_ok` turns that into a skip of the test.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import itertools
import os
import time
import warnings
import weakref
from typing import Any, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.modules.batchnorm import _BatchNorm

from harness.case import PRECISIONS
from harness.models import gpu_sleep
from harness.pool import PoolOutcome
from harness.rank import RankContext
from harness.trace import TRACED, OpKind
from suites.mixed_precision.models import (
    BUFFER_ORIG_DTYPE,
    BatchNormNet,
    Expectation,
    ModelWithIgnoredModule,
    ParityNet,
    PrecisionProbe,
    SaveForwardInputsModel,
    SharedParamsTransformer,
    TransformerWithEMA,
)
from suites.mixed_precision.reference import (
    CastPlan,
    compare_to_reference,
    derive_tolerance,
    float64_plan,
    run_reference,
    single_cast_ablations,
)
from suites.seeds.api import FSDPApi, clean, load_api

#: the seed's mixed-precision configurations (``mp_diff_buffer_reduce`` is its NCCL>=2.10 one).
MP_CONFIGS: dict[str, dict[str, str]] = {
    "mp_fp16": {"param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16"},
    "mp_only_reduce": {"reduce_dtype": "float16"},
    "mp_only_param_and_buf": {"param_dtype": "float16", "buffer_dtype": "float16"},
    "mp_no_mp": {},
    "mp_diff_buffer_reduce": {"param_dtype": "float16", "buffer_dtype": "bfloat16", "reduce_dtype": "float32"},
}
#: backward prefetch by test-id name -> ``BackwardPrefetch`` member name (None: no prefetch).
PREFETCH: dict[str, str | None] = {"none": None, "pre": "BACKWARD_PRE", "post": "BACKWARD_POST"}
#: FSDP1's environment variable for full precision in eval, read when a unit is constructed (torch
#: FSDP1 reads ``torch.distributed.fsdp._flat_param._FSDP_USE_FULL_PREC_IN_EVAL``; our engine
#: ``engine.precision.FULL_PREC_IN_EVAL_ENV``; test_mixed_precision.py checks both names agree).
FULL_PREC_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"
#: the module holding each engine's ``ShardedGradScaler`` (``FSDPApi`` does not carry it).
GRAD_SCALER_MODULES: dict[str, str] = {
    "builtin": "engine",
    "torch-fsdp": "torch.distributed.fsdp.sharded_grad_scaler",
}


def dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def engine_api(payload: dict[str, Any]) -> FSDPApi:
    """The FSDP1 API of the engine the payload names (``payload["engine"]``, the ``fsdp_api`` fixture)."""
    if "engine" not in payload:
        raise KeyError("payload['engine'] must name the engine under test (builtin or torch-fsdp): pass the fsdp_api fixture")
    return load_api(payload["engine"])


def grad_scaler_class(engine: str) -> type:
    """The engine's ``ShardedGradScaler`` class."""
    if engine not in GRAD_SCALER_MODULES:
        raise ValueError(f"engine={engine!r} has no ShardedGradScaler here; known: {sorted(GRAD_SCALER_MODULES)}")
    return importlib.import_module(GRAD_SCALER_MODULES[engine]).ShardedGradScaler


def strategy(api: FSDPApi, name: str) -> Any:
    return getattr(api.ShardingStrategy, name)


def prefetch(api: FSDPApi, name: str) -> Any:
    member = PREFETCH[name]
    return None if member is None else getattr(api.BackwardPrefetch, member)


def make_mp(api: FSDPApi, name: str, **overrides: Any) -> Any:
    fields = {k: dtype(v) for k, v in MP_CONFIGS[name].items()}
    return api.MixedPrecision(**fields, **overrides)


def device_kwargs(ctx: RankContext) -> dict[str, Any]:
    """``device_id`` on GPUs, as the seed passes it; on CPU ``FSDPApi.wrap`` adds what the engine needs."""
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
_INPUT_KEYWORDS = ("input_tensor", "input", "tensor")


@dataclasses.dataclass(frozen=True)
class TensorSeen:
    """One tensor a collective was called with."""

    dtype: torch.dtype
    device: torch.device
    #: the storage's address at call time.
    storage_ptr: int
    #: the storage itself, weakly: recording must not keep freed memory alive. A storage's Python
    #: object lives as long as the storage does (torch preserves it), whichever tensor views it.
    storage: weakref.ref


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective call as the engine made it."""

    #: the ``torch.distributed`` function called.
    name: str
    #: the input tensor (the local shard of an all-gather, the unsharded gradient of a reduce-scatter);
    #: None for the list-input ``reduce_scatter``.
    input: TensorSeen | None
    #: every tensor of the call (inputs and outputs, list elements included).
    tensors: tuple[TensorSeen, ...]


def _seen(t: Tensor) -> TensorSeen:
    storage = t.untyped_storage()
    return TensorSeen(t.dtype, t.device, storage.data_ptr(), weakref.ref(storage))


@contextlib.contextmanager
def recorded(role: OpKind) -> Iterator[list[CollectiveCall]]:
    """Patch every ``torch.distributed`` function of a collective kind that this torch has (the
    names of :data:`harness.trace.TRACED`), to record each call. Engines look collectives up on
    ``torch.distributed`` at call time, as the seed's patch relies on; but not under one name:
    torch 2.13's FSDP1 calls the ``*_single`` functions (torch 2.11's, and our engine on both, the
    ``*_tensor`` ones) and gathers a CPU shard with ``all_gather`` into chunks of the output. 2.13's
    ``*_tensor`` forward to ``*_single`` inside ``distributed_c10d`` (not patched here), so each call
    the engine makes is recorded once."""
    calls: list[CollectiveCall] = []
    names = [n for n, kind in TRACED.items() if kind == role and hasattr(dist, n)]
    if not names:
        raise ValueError(f"recorded(role={role!r}): no torch.distributed function of that kind in harness.trace.TRACED")

    def spy_for(name: str, original: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            flat = [*args, *kwargs.values()]
            tensors = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, Tensor)]
            positional = 0 if role == "all_reduce" else 1
            if len(args) > positional:
                inp = args[positional]
            else:
                inp = next((kwargs[k] for k in _INPUT_KEYWORDS if k in kwargs), None)
            seen_input = _seen(inp) if isinstance(inp, Tensor) else None
            calls.append(CollectiveCall(name, seen_input, tuple(_seen(t) for t in tensors)))
            return original(*args, **kwargs)

        return spy

    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(dist, name, spy_for(name, getattr(dist, name))))
        yield calls


def _dtypes(calls: list[CollectiveCall]) -> set[torch.dtype]:
    return {t.dtype for call in calls for t in call.tensors}


# ---------------------------------------------------------------------------- end to end
def _probe_models(api: FSDPApi, full: torch.dtype, device: torch.device, kwargs: dict[str, Any]) -> Iterator[nn.Module]:
    """The seed's simple model (one probe) and nested model (a probe unit inside a root with a probe)."""
    torch.manual_seed(0)
    yield api.wrap(PrecisionProbe(full).to(device), **kwargs)
    torch.manual_seed(0)
    inner = api.wrap(PrecisionProbe(full, buffer_name="buffer0").to(device), **kwargs)
    yield api.wrap(nn.Sequential(inner, PrecisionProbe(full, buffer_name="buffer1").to(device)), **kwargs)


def _storage_ptrs(model: nn.Module) -> set[int]:
    """Storage of the registered (sharded) parameters, taken while every unit is at rest."""
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _check_gathers(
    calls: list[CollectiveCall], shard_ptrs: set[int], expect_param: torch.dtype, must_copy: bool
) -> list[weakref.ref]:
    """Each all-gather input (the local shard) is in the compute dtype, and is a separate copy of the
    registered shard exactly when it must be (parameter mixed precision, or a device move). Returns
    weak references to the copies, which the caller checks are freed (:func:`_assert_released`)."""
    copies = []
    for call in calls:
        shard = call.input
        assert shard is not None, f"{call.name} has no input tensor to check"
        assert shard.dtype == expect_param, f"{call.name} input in {shard.dtype}, expected {expect_param}"
        copied = shard.storage_ptr not in shard_ptrs
        assert copied == must_copy, f"{call.name} input copied={copied} but expected {must_copy}"
        if copied:
            copies.append(shard.storage)
    return copies


def _freed(ref: weakref.ref) -> bool:
    """The storage is gone (our engine drops its shard copy) or resized to nothing (torch FSDP1 keeps
    its low-precision shard tensor and frees the storage under it, as the seed checks)."""
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


def _check_buffers(model: nn.Module, expected: torch.dtype, when: str) -> None:
    for name, buf in model.named_buffers():
        assert buf.dtype == expected, f"{when}: buffer {name} is {buf.dtype}, expected {expected}"


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
    expect_reduce = mp.reduce_dtype or mp.param_dtype or full
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
            _check_buffers(model, expect_buffer, "after forward")
            if sharded:
                released(_check_gathers(gathers, shard_ptrs, expect_param, must_copy))
            loss = scaler.scale(act.sum())
            assert loss.dtype == expect_param, f"scaled loss is {loss.dtype}, expected {expect_param}"
            with recorded(reduce_op) as reductions, recorded("all_gather") as gathers:
                loss.backward()
            assert reductions, f"no {reduce_op} in backward"
            assert _dtypes(reductions) == {expect_reduce}, f"reduced in {_dtypes(reductions)}, expected {expect_reduce}"
            if sharded:
                released(_check_gathers(gathers, shard_ptrs, expect_param, must_copy))
            _check_buffers(model, expect_buffer, "after backward")
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
                _check_buffers(model, expect_buffer, "inside summon_full_params")
            if sharded:
                # Summoning gathers the full-precision shard itself: no low-precision copy.
                released(_check_gathers(gathers, shard_ptrs, full, offload and device.type != "cpu"))
            _check_state_dict(api, model, full, summoned)
            _check_buffers(model, expect_buffer, "after state_dict")
        _assert_released(copies)


def e2e_matrix(ctx: RankContext, payload: dict[str, Any]) -> int:
    """The seed's ``test_mixed_precision_e2e_full_shard`` product for one mp config and one CPU
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
        payload.get("prefetch", [(fwd, bwd) for fwd in (False, True) for bwd in PREFETCH]),
    )
    count = 0
    for full, scaler, (fwd, bwd) in combos:
        sharding = strategy(api, payload["strategy"])
        _run_e2e(api, ctx, mp, sharding, offload, dtype(full), scaler, prefetch(api, bwd), fwd, group)
        count += 1
    return count


# ---------------------------------------------------------------------------- gradients
class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(10, 10)
        self.lin2 = nn.Linear(10, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin2(self.lin1(x))


def grads_reduced_precision(ctx: RankContext, payload: dict[str, Any]) -> None:
    """``keep_low_precision_grads``: gradients stay in the low dtype over six accumulating backwards
    (per CPU offload value, x use_orig_params)."""
    api = engine_api(payload)
    offload = payload.get("offload", False)
    api.require_offload(offload)
    low = dtype(payload.get("low", "float16"))
    group = ctx.world_group() if payload.get("world", 2) == 2 else ctx.singleton_group()
    for orig in (False, True):
        torch.manual_seed(0)
        m = _TwoLinears().to(ctx.device)
        mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low, keep_low_precision_grads=True)
        kwargs = dict(
            process_group=group, mixed_precision=mp, cpu_offload=api.CPUOffload(offload), use_orig_params=orig,
            **device_kwargs(ctx),
        )
        m.lin1 = api.wrap(m.lin1, **kwargs)
        m = api.wrap(m, **kwargs)
        for _ in range(6):
            m(torch.ones(1, 10, device=ctx.device)).sum().backward()
            grads = [(n, p.grad.dtype) for n, p in m.named_parameters() if p.grad is not None]
            assert grads and all(d == low for _, d in grads), (offload, orig, grads)
        for name, p in m.named_parameters():
            assert p.dtype == torch.float32, f"{name} is {p.dtype}: only the gradients stay low"
        # foreach kernels (the CUDA default) need each gradient in its parameter's dtype; the
        # per-tensor path steps full-precision parameters with low-precision gradients, as
        # keep_low_precision_grads users must choose.
        torch.optim.SGD(m.parameters(), lr=0.1, foreach=False).step()


def input_grads_with_param_mp(ctx: RankContext, payload: dict[str, Any]) -> None:
    """An input that requires grad gets its gradient, in its own dtype, through the input cast."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    for name, orig in itertools.product(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], [False, True]):
        torch.manual_seed(0)
        model = api.wrap(
            nn.Linear(64, 64, bias=False),
            sharding_strategy=strategy(api, name),
            mixed_precision=api.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=torch.float32),
            use_orig_params=orig,
            **device_kwargs(ctx),
        )
        x = torch.randn(8, 64, device=ctx.device, requires_grad=True)
        model(x).sum().backward()
        assert x.grad is not None, (name, orig)
        assert x.grad.dtype == torch.float32, (name, orig, x.grad.dtype)


def no_sync_mixed_precision(ctx: RankContext, payload: dict[str, Any]) -> None:
    """Inside ``no_sync()`` the accumulated gradient is low precision; after the synced backward
    it is reduced and full precision."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    for name, orig in itertools.product(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], [False, True]):
        torch.manual_seed(0)
        model = api.wrap(
            nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).to(ctx.device),
            sharding_strategy=strategy(api, name),
            mixed_precision=api.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32),
            use_orig_params=orig,
        )
        x = torch.randn(4, 6, device=ctx.device)
        with model.no_sync():
            for _ in range(2):
                model(x).sum().backward()
                grads = [p.grad for p in model.parameters()]
                if orig:
                    # Both engines: the original parameters show the accumulated low-precision gradient.
                    dtypes = {g.dtype for g in grads if g is not None}
                    assert dtypes == {low}, (name, orig, dtypes)
                elif api.is_torch:
                    # torch FSDP1 hangs the unsharded low-precision gradient on the registered flat
                    # parameter, whatever its (sharded) size.
                    seen = [g if g is None else g.dtype for g in grads]
                    assert all(g is not None and g.dtype == low for g in grads), (name, seen)
                else:
                    # Our engine keeps the registered flat parameter a shard and accumulates on its
                    # internal unsharded parameter: no gradient of another shape is exposed.
                    assert all(g is None for g in grads), (name, [g.dtype for g in grads if g is not None])
        model(x).sum().backward()
        grads = [p.grad.dtype for p in model.parameters() if p.grad is not None]
        assert grads and set(grads) == {torch.float32}, (name, orig, grads)
        sizes = [(tuple(p.shape), tuple(p.grad.shape)) for p in model.parameters() if p.grad is not None]
        assert all(a == b for a, b in sizes), f"{name} orig={orig}: synced gradients not in their parameters' shapes: {sizes}"


# ---------------------------------------------------------------------------- embedding tables
def embedding_table(ctx: RankContext, payload: dict[str, Any]) -> None:
    """Integer inputs are never cast (embedding lookups work); the loss is in the compute dtype
    and gradients are reduced in the reduce dtype."""
    api = engine_api(payload)
    for name in payload["mps"]:
        fields = {k: dtype(v) for k, v in payload["mps"][name].items()}
        mp = api.MixedPrecision(**fields)
        param_dtype = mp.param_dtype or torch.float32
        expect_reduce = mp.reduce_dtype or mp.param_dtype or torch.float32
        torch.manual_seed(0)
        model = api.wrap(SharedParamsTransformer().to(ctx.device), mixed_precision=mp, **device_kwargs(ctx))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            inp = SharedParamsTransformer.get_input(ctx.device, seed=step)
            loss = SharedParamsTransformer.get_loss(inp, model(*inp))
            assert loss.dtype == param_dtype, (name, loss.dtype)
            with recorded("reduce_scatter") as reductions:
                loss.backward()
            assert reductions and _dtypes(reductions) == {expect_reduce}, (name, _dtypes(reductions))
            optim.step()
            optim.zero_grad()


# ---------------------------------------------------------------------------- batch norm
def _never_wrap(*args: Any, **kwargs: Any) -> bool:
    return False


def mp_batchnorm(ctx: RankContext, payload: dict[str, Any]) -> None:
    """``_module_classes_to_ignore`` modules become separate full-precision units, with the warning,
    and forward/backward run (``forward=False`` checks the wrapping only: SyncBatchNorm computes
    only on GPUs)."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    torch.manual_seed(0)
    net = BatchNormNet().to(ctx.device)
    if payload["convert_sync_bn"]:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    mp = api.MixedPrecision(
        param_dtype=low, reduce_dtype=low, buffer_dtype=low, _module_classes_to_ignore=[_BatchNorm, nn.LayerNorm]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = api.wrap(net, mixed_precision=mp, auto_wrap_policy=_never_wrap, **device_kwargs(ctx))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("These modules will be wrapped as separate FSDP" in m for m in messages), messages
    for mod in (model.ln, model.bn):
        assert isinstance(mod, api.FSDP), type(mod)
        assert mod.mixed_precision == api.MixedPrecision(), mod.mixed_precision
    for mod in (model.fc1, model.fc2, model.fc3):
        assert not isinstance(mod, api.FSDP), type(mod)
    assert model.mixed_precision == mp
    if not payload.get("forward", True):
        return
    out = model(torch.randn((1, 2), device=ctx.device))
    out.sum().backward()
    assert out.dtype == low, out.dtype
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, f"batch-norm buffer {name} is {buf.dtype}: its unit has no mixed precision"


def resnet50(ctx: RankContext, payload: dict[str, Any]) -> int:
    """ResNet-50 with SyncBatchNorm, size-based auto wrapping and fp16: every batch norm is its own
    full-precision unit and forward/backward run (without that, dtypes would mismatch)."""
    import torchvision

    api = engine_api(payload)
    model = torchvision.models.resnet50().to(ctx.device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=ctx.world_group())
    n_bn = sum(isinstance(m, _BatchNorm) for m in model.modules())
    mp = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fsdp = api.wrap(model, auto_wrap_policy=api.policy("size_based_auto_wrap_policy"), mixed_precision=mp)
    fsdp_bn = sum(isinstance(m.module, _BatchNorm) for m in api.FSDP.fsdp_modules(fsdp))
    assert fsdp_bn == n_bn, (fsdp_bn, n_bn)
    size = payload.get("size", 1000)
    loss = fsdp(torch.ones(1, 3, size, size, device=ctx.device)).sum()
    loss.backward()
    return n_bn


# ---------------------------------------------------------------------------- eval
def eval_root_cast_inputs(ctx: RankContext, payload: dict[str, Any]) -> None:
    """A root without parameters still casts its inputs, except in eval with full precision in eval."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 5)

        def forward(self, x: Tensor, expect_full: bool) -> Tensor:
            want = torch.float32 if expect_full else low
            assert x.dtype == want, f"root input is {x.dtype}, expected {want}"
            return self.a(x)

    mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low)
    for use_full in (True, False):
        with full_prec_in_eval(use_full):
            m = Model().to(ctx.device)
            m.a = api.wrap(m.a, mixed_precision=mp, **device_kwargs(ctx))
            model = api.wrap(m, mixed_precision=mp, **device_kwargs(ctx))
        model.eval()
        model(torch.randn(5, 5, device=ctx.device), use_full).sum().backward()


def _transformer(api: FSDPApi, mp: Any, ctx: RankContext, recursive: bool, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    model = SharedParamsTransformer().to(ctx.device)
    policy = api.policy("ModuleWrapPolicy")({TransformerEncoderLayer, TransformerDecoderLayer}) if recursive else None
    with warnings.catch_warnings():
        # The batch norm's own unit warns; that warning is checked in mp_batchnorm.
        warnings.simplefilter("ignore", UserWarning)
        return api.wrap(model, auto_wrap_policy=policy, mixed_precision=mp, **device_kwargs(ctx), **kwargs)


def full_precision_in_eval(ctx: RankContext, payload: dict[str, Any]) -> None:
    """In eval with FSDP_USE_FULL_PREC_IN_EVAL=1 the loss is full precision; in train it is low
    (the seed's product, each combination under a different strategy and use_orig_params)."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    layouts = itertools.cycle([("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False), ("FULL_SHARD", True)])
    for (cast_inputs, use_full), (name, orig) in zip(itertools.product([True, False], [True, False]), layouts):
        mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low, cast_forward_inputs=cast_inputs)
        with full_prec_in_eval(use_full):
            model = _transformer(api, mp, ctx, recursive=True, sharding_strategy=strategy(api, name), use_orig_params=orig)
        inp = SharedParamsTransformer.get_input(ctx.device)
        loss = SharedParamsTransformer.get_loss(inp, model(*inp))
        assert loss.dtype == low, (cast_inputs, use_full, loss.dtype)
        loss.backward()
        for pname, p in model.named_parameters():
            assert p.grad is None or p.grad.dtype == torch.float32, (pname, p.grad.dtype)
        model.eval()
        inp = SharedParamsTransformer.get_input(ctx.device, seed=1)
        loss = SharedParamsTransformer.get_loss(inp, model(*inp))
        want = torch.float32 if use_full else low
        assert loss.dtype == want, (name, orig, cast_inputs, use_full, loss.dtype)
        loss.backward()  # a backward in eval reduces in full precision too (checked in _comm)
        for pname, p in model.named_parameters():
            assert p.grad is None or p.grad.dtype == torch.float32, (pname, p.grad.dtype)
        # And back to low precision in train mode.
        model.train()
        loss = SharedParamsTransformer.get_loss(inp, model(*inp))
        assert loss.dtype == low, ("train after eval", name, orig, cast_inputs, use_full, loss.dtype)
        loss.backward()


def full_precision_in_eval_buffers(ctx: RankContext, payload: dict[str, Any]) -> None:
    """In eval with full precision in eval, buffers are in their original dtype during and after
    forward, and back in the buffer dtype after a forward in train mode."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    for cast_inputs, use_full in itertools.product([True, False], [True, False]):
        mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low, cast_forward_inputs=cast_inputs)
        with full_prec_in_eval(use_full):
            torch.manual_seed(0)
            kwargs = dict(mixed_precision=mp, **device_kwargs(ctx))
            inner = api.wrap(PrecisionProbe(torch.float32, "buffer0", run_checks=False).to(ctx.device), **kwargs)
            model = api.wrap(nn.Sequential(inner, PrecisionProbe(torch.float32, "buffer1", run_checks=False).to(ctx.device)), **kwargs)
        inp = torch.randn(3, 10, device=ctx.device)
        model((inp, None))
        _check_buffers(model, low, "train forward")
        eval_dtype = BUFFER_ORIG_DTYPE if use_full else low
        seen: list[torch.dtype] = []

        def record(module: nn.Module, args: Any) -> None:
            seen.extend(b.dtype for b in module.buffers())

        hooks = [model[0].module.register_forward_pre_hook(record), model[1].register_forward_pre_hook(record)]
        model.eval()
        model((inp, None))
        for h in hooks:
            h.remove()
        assert seen and set(seen) == {eval_dtype}, (cast_inputs, use_full, seen)
        _check_buffers(model, eval_dtype, "after eval forward")
        model.train()
        model((inp, None))
        _check_buffers(model, low, "train forward after eval")


def full_precision_in_eval_comm(ctx: RankContext, payload: dict[str, Any]) -> None:
    """In eval with full precision in eval, gradients are reduced in full precision."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    for cast_inputs, use_full in itertools.product([True, False], [True, False]):
        mp = api.MixedPrecision(
            param_dtype=torch.float32,
            reduce_dtype=low,
            buffer_dtype=torch.float32,
            cast_forward_inputs=cast_inputs,
            _module_classes_to_ignore=[],
        )
        with full_prec_in_eval(use_full):
            model = _transformer(api, mp, ctx, recursive=True)
        model.eval()
        inp = SharedParamsTransformer.get_input(ctx.device)
        loss = SharedParamsTransformer.get_loss(inp, model(*inp))
        with recorded("reduce_scatter") as reductions:
            loss.backward()
        want = torch.float32 if use_full else low
        assert reductions and _dtypes(reductions) == {want}, (cast_inputs, use_full, _dtypes(reductions))


# ---------------------------------------------------------------------------- ignored modules
def ignored_modules(ctx: RankContext, payload: dict[str, Any]) -> None:
    """Parameters (and buffers) of ignored modules keep their dtype: feeding them low-precision
    activations raises; casting around them works."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    mp = api.MixedPrecision(param_dtype=low, buffer_dtype=low)
    torch.manual_seed(0)
    model = ModelWithIgnoredModule().to(ctx.device)
    fsdp = api.wrap(model, ignored_modules=[model.ignored], mixed_precision=mp, **device_kwargs(ctx))
    x = torch.ones(2, 32, device=ctx.device)
    try:
        fsdp(x).sum().backward()
    except RuntimeError as e:
        assert "must have the same dtype" in str(e), str(e)
    else:
        raise AssertionError("low-precision activations into an ignored float32 module did not raise")
    assert all(p.dtype == torch.float32 for p in model.ignored.parameters())

    torch.manual_seed(0)
    model = ModelWithIgnoredModule(cast_for_ignored=True).to(ctx.device)
    fsdp = api.wrap(model, ignored_modules=[model.ignored], mixed_precision=mp, **device_kwargs(ctx))
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    for _ in range(2):
        out = fsdp(x)
        assert out.dtype == low, out.dtype
        out.float().sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
    for name, p in model.ignored.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, (name, p.dtype)
    assert model.ignored.scale.dtype == torch.float32, model.ignored.scale.dtype
    managed = {n: b.dtype for n, b in fsdp.named_buffers() if ".ignored." not in n}
    assert managed and set(managed.values()) == {low}, managed


# ---------------------------------------------------------------------------- per-submodule precision
def submodule_precision(ctx: RankContext, payload: dict[str, Any]) -> dict[str, str]:
    """One submodule in low precision inside a full-precision model: the working layouts record
    the expected input dtypes; the raising ones raise "must have the same dtype"."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    f32 = torch.float32
    results: dict[str, str] = {}

    def layout(name: str, model_cast: bool, child_mp: Any, root_mp: Any, child: str) -> tuple | None:
        inputs: dict[Any, Tensor] = {}
        torch.manual_seed(0)
        model = SaveForwardInputsModel(inputs, cast_forward_inputs=model_cast).to(ctx.device)
        c1, c2 = model.c1, model.c2
        setattr(model, child, api.wrap(getattr(model, child), mixed_precision=child_mp, **device_kwargs(ctx)))
        fsdp = api.wrap(model, mixed_precision=root_mp, **device_kwargs(ctx))
        x = torch.zeros(2, 16, device=ctx.device)
        try:
            fsdp(x).sum().backward()
        except RuntimeError as e:
            if "must have the same dtype" not in str(e):
                raise
            results[name] = "raised"
            return None
        got = (inputs[model].dtype, inputs[c1].dtype, inputs[c2].dtype)
        results[name] = str(got)
        return got

    cast_low = api.MixedPrecision(param_dtype=low, cast_forward_inputs=True)
    no_cast_low = api.MixedPrecision(param_dtype=low, cast_forward_inputs=False)
    cast_f32 = api.MixedPrecision(param_dtype=f32, cast_forward_inputs=True)
    assert layout("low_on_c2", False, cast_low, None, "c2") == (f32, f32, low), results
    assert layout("low_on_c2_module_casts", True, no_cast_low, None, "c2") == (f32, f32, f32), results
    assert layout("low_on_c2_no_cast", False, no_cast_low, None, "c2") is None, results
    assert layout("low_on_c1_under_f32_root", False, cast_low, cast_f32, "c1") is None, results
    assert layout("low_on_c2_under_f32_root", False, cast_low, cast_f32, "c2") == (f32, f32, low), results
    return results


def submodule_external_inputs(ctx: RankContext, payload: dict[str, Any]) -> None:
    """Root inputs are cast; a tensor a submodule receives from elsewhere is not."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    seen: dict[str, Tensor] = {}

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(16, 16)

        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            seen["l2_input_x"], seen["l2_input_y"] = x, y
            return self.l(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(16, 16)
            self.l2 = Inner()

        def forward(self, x: Tensor) -> Tensor:
            seen["model_input_x"] = x
            y = torch.ones(2, 16, device=x.device, dtype=torch.float32)
            return self.l2(self.l1(x), y)

    mp = api.MixedPrecision(param_dtype=low)
    model = Outer().to(ctx.device)
    model.l2 = api.wrap(model.l2, mixed_precision=mp, **device_kwargs(ctx))
    fsdp = api.wrap(model, mixed_precision=mp, **device_kwargs(ctx))
    fsdp(torch.zeros(2, 16, device=ctx.device)).sum().backward()
    got = {k: v.dtype for k, v in seen.items()}
    assert got == {"model_input_x": low, "l2_input_x": low, "l2_input_y": torch.float32}, got


# ---------------------------------------------------------------------------- train / EMA / eval
def train_ema_eval(ctx: RankContext, payload: dict[str, Any]) -> dict[str, list[float]]:
    """Train -> EMA update (inside summon_full_params) -> eval on the EMA model, three times per
    strategy: the eval outputs change every iteration (eval uses the updated EMA parameters)."""
    api = engine_api(payload)
    low = dtype(payload.get("low", "float16"))
    d_model = payload.get("d_model", 16)
    out: dict[str, list[float]] = {}
    for name in ("SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"):
        torch.manual_seed(0)
        model = TransformerWithEMA(d_model).to(ctx.device)
        policy = api.policy("ModuleWrapPolicy")({nn.Transformer, TransformerEncoderLayer, TransformerDecoderLayer})
        fsdp = api.wrap(
            model, auto_wrap_policy=policy, mixed_precision=api.MixedPrecision(param_dtype=low),
            sharding_strategy=strategy(api, name), **device_kwargs(ctx),
        )
        optim = torch.optim.Adam(fsdp.module.parameters(), lr=1e-2)
        torch.manual_seed(1 + ctx.rank)
        eval_src = torch.randn((8, 1, d_model), device=ctx.device)
        eval_tgt = torch.randn((16, 1, d_model), device=ctx.device)
        sums: list[float] = []
        for _ in range(3):
            fsdp.train()
            fsdp(torch.randn((8, 4, d_model), device=ctx.device), torch.randn((16, 4, d_model), device=ctx.device)).sum().backward()
            optim.step()
            optim.zero_grad()
            with api.FSDP.summon_full_params(fsdp):
                fsdp.ema_module.update_parameters(fsdp.module)
            fsdp.eval()
            with torch.no_grad():
                sums.append(fsdp(eval_src, eval_tgt).float().sum().item())
        assert all(a != b for a, b in zip(sums, sums[1:])) and sums[0] != sums[-1], (name, sums)
        out[name] = sums
    return out


# ---------------------------------------------------------------------------- grad scaler
def _scaler_model(api: FSDPApi, ctx: RankContext, mp: Any, offload: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(ctx.device)
    kwargs = dict(mixed_precision=mp, cpu_offload=api.CPUOffload(offload), **device_kwargs(ctx))
    model[2] = api.wrap(model[2], **kwargs)
    return api.wrap(model, **kwargs)


def _snapshot(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _poison(model: nn.Module) -> None:
    """An inf in this rank's gradient shard only."""
    for p in model.parameters():
        if p.grad is not None and p.grad.numel():
            p.grad.view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient to poison on this rank")


#: GPU sleep before each scaler step: far longer than the CPU unscale of the scaler job.
GPU_BUSY_MS = 100.0


def grad_scaler_agreement(ctx: RankContext, payload: dict[str, Any]) -> dict[str, Any]:
    """An inf in one rank's shard makes every rank skip the step and back the scale off; a clean
    step updates everywhere. ``scaler="plain"`` runs torch's GradScaler for contrast (it does not
    agree: the test that reads this expects disagreement)."""
    api = engine_api(payload)
    offload = payload.get("offload", False)
    api.require_offload(offload)
    low = dtype(payload.get("low"))
    keep_low = payload.get("keep_low", False)
    mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, keep_low_precision_grads=keep_low) if low else None
    model = _scaler_model(api, ctx, mp, offload)
    # foreach=False: on CUDA the default foreach SGD refuses float16 gradients on float32 parameters
    # (keep_low_precision_grads). torch FSDP1's flat parameters are plain nn.Parameter, so torch picks
    # foreach and raises; ours are a subclass, for which torch never picks foreach. That is the
    # optimizer's choice, not the scaler's contract this job checks.
    optim = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    if payload.get("scaler", "sharded") == "plain":
        scaler = torch.amp.GradScaler(ctx.device.type, init_scale=2.0**8)
    else:
        scaler = grad_scaler_class(api.name)(device=ctx.device.type, init_scale=2.0**8)
    x = torch.randn(4, 8, device=ctx.device)
    result: dict[str, Any] = {}
    for step, poisoned_rank in enumerate([None, 1, None]):
        before = _snapshot(model)
        loss = scaler.scale(model(x).float().pow(2).mean())
        loss.backward()
        grads = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        devices = sorted({p.grad.device.type for p in model.parameters() if p.grad is not None})
        if poisoned_rank == ctx.rank:
            _poison(model)
        # Keep the GPU busy (no-op on CPU): a scaler whose CPU side reads a non-blocking device-to-host
        # copy (scale or inf flag for CPU-offloaded gradients) before it lands now reads it early
        # every time, not only when the GPU happens to be loaded.
        gpu_sleep(GPU_BUSY_MS, ctx.device)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
        result[f"step{step}"] = {"stepped": changed, "scale": scaler.get_scale(), "grads": grads, "grad_devices": devices}
    return result


# ---------------------------------------------------------------------------- parity
def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def parity_precision(ctx: RankContext, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine vs the emulating reference for one precision config of the harness matrix.

    The emulating, float64 and single-cast-ablation references are trained here, on this rank's
    device, from the same initial model and every rank's batches; the tolerance is derived from
    them. Each case wraps a copy with the engine, trains it on this rank's batches and compares
    its final full parameters. With ``guards``, mixed configs add cases that run the engine with
    casts dropped (all of them, then each one): a guard whose dropped cast changes the numbers
    (``must_fail``) must fail the comparison, which shows the check does not look away.
    """
    api = engine_api(payload)
    cases = list(payload["cases"])
    for case in cases:
        api.require_offload(case.get("offload", False))  # before any collective, on every rank alike
    name = payload["precision"]
    plan = CastPlan.from_spec(PRECISIONS[name])
    steps = payload.get("steps", 5)
    device = ctx.device
    torch.manual_seed(0)
    base = ParityNet().to(device)

    def inputs(step: int, rank: int) -> tuple[Tensor, ...]:
        return tuple(t.to(device) for t in ParityNet.input(step, rank))

    def reference(p: CastPlan) -> dict[str, Tensor]:
        return run_reference(base, p, ctx.world_size, steps, inputs, ParityNet.loss, _sgd)

    emulated, fp64 = reference(plan), reference(float64_plan())
    ablations = single_cast_ablations(plan)
    tolerance = derive_tolerance(emulated, fp64, plan.full, neighbours={n: reference(p) for n, p in ablations.items()})
    if payload.get("guards") and PRECISIONS[name].is_mixed:
        cases += [{"strategy": "FULL_SHARD", "drop_casts": d} for d in ["all"] + [n.removeprefix("no_") for n in ablations]]
    records = []
    for case in cases:
        dropped = case.get("drop_casts")
        model = copy.deepcopy(base)
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(plan.full)
        kept = {"param_dtype": plan.param, "reduce_dtype": plan.reduce, "buffer_dtype": plan.buffer}
        if dropped and dropped != "all":
            kept[f"{dropped}_dtype"] = None
        wrapped = model.wrap(
            api.wrap,
            mixed_precision=None if dropped == "all" else api.MixedPrecision(**kept),
            sharding_strategy=strategy(api, case["strategy"]),
            use_orig_params=case.get("orig", False),
            cpu_offload=api.CPUOffload(offload_params=case.get("offload", False)),
            backward_prefetch=prefetch(api, case.get("bwd", "pre")),
            forward_prefetch=case.get("fwd", False),
            **device_kwargs(ctx),
        )
        optim = _sgd(wrapped.parameters())
        for step in range(steps):
            x = tuple(t.to(plan.full) for t in inputs(step, ctx.rank))
            ParityNet.loss(wrapped(*x)).backward()
            optim.step()
            optim.zero_grad()
        with api.FSDP.summon_full_params(wrapped):
            params = {clean(n): p.detach().clone() for n, p in wrapped.named_parameters()}
        comparison = compare_to_reference(params, emulated, tolerance)
        case_id = "-".join(
            [case["strategy"].lower()]
            + (["orig"] if case.get("orig") else [])
            + (["offload"] if case.get("offload") else [])
            + [f"bwd_{case.get('bwd', 'pre')}"]
            + (["fwd"] if case.get("fwd") else [])
            + ([f"drop_{dropped}"] if dropped else [])
        )
        must_fail = dropped == "all" or (bool(dropped) and f"no_{dropped}" in tolerance.resolvable)
        records.append(
            {"engine": api.name, "precision": name, "case": case_id, "plan": plan.describe(), "drop_casts": dropped or "",
             "must_fail": must_fail, **comparison.to_dict()}
        )
    return records
