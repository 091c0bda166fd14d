"""Rank jobs on gradients under mixed precision: low-precision gradients kept, input gradients through
the input cast, accumulation in ``no_sync()``, and the reduce dtype of an embedding model's gradients."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from harness.cases.case import reduce_dtype_default
from harness.cases.dtypes import dtype_of
from harness.cases.models import TransformerModel, to_device
from harness.conformance.mixed_precision.rank_api import device_kwargs, engine_api, recorded, reduced_dtypes, strategy
from harness.engines.adapters import fsdp1_mixed_precision
from harness.ranks.rank import RankContext


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
    low = dtype_of(payload.get("low", "float16"))
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
    low = dtype_of(payload.get("low", "float16"))
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
    low = dtype_of(payload.get("low", "float16"))
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
        mp = fsdp1_mixed_precision(api, payload["mps"][name])
        param_dtype = mp.param_dtype or torch.float32
        expect_reduce = reduce_dtype_default(torch.float32, mp.param_dtype, mp.reduce_dtype)
        torch.manual_seed(0)
        model = api.wrap(TransformerModel(batch_norm=True).to(ctx.device), mixed_precision=mp, **device_kwargs(ctx))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            inp = to_device(model.get_input(seed=0, step=step, rank=ctx.rank), ctx.device)
            loss = model.get_loss(inp, model(*inp))
            assert loss.dtype == param_dtype, (name, loss.dtype)
            with recorded("reduce_scatter") as reductions:
                loss.backward()
            assert reductions and reduced_dtypes(reductions) == {expect_reduce}, (name, reduced_dtypes(reductions))
            optim.step()
            optim.zero_grad()
