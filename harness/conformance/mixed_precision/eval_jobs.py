"""Rank jobs on evaluation: full precision in eval (``FSDP_USE_FULL_PREC_IN_EVAL``) for inputs, losses,
buffers and reductions, and train -> EMA -> eval cycles."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer

from harness.cases.dtypes import dtype_of
from harness.cases.models import TransformerModel, to_device
from harness.conformance.fsdp1_checks import FSDPApi
from harness.conformance.mixed_precision.models import BUFFER_ORIG_DTYPE, PrecisionProbe, TransformerWithEMA
from harness.conformance.mixed_precision.rank_api import (
    check_buffers,
    device_kwargs,
    engine_api,
    full_prec_in_eval,
    recorded,
    reduced_dtypes,
    strategy,
)
from harness.ranks.rank import RankContext


# ---------------------------------------------------------------------------- eval
def eval_root_cast_inputs(ctx: RankContext, payload: dict[str, Any]) -> None:
    """A root without parameters still casts its inputs, except in eval with full precision in eval."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))

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


def _batch(model: nn.Module, ctx: RankContext, step: int) -> tuple[Tensor, ...]:
    """This rank's batch of ``step`` for the wrapped ``TransformerModel`` (the wrapper forwards ``get_input``)."""
    return to_device(model.get_input(seed=0, step=step, rank=ctx.rank), ctx.device)


def _transformer(api: FSDPApi, mp: Any, ctx: RankContext, recursive: bool, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    model = TransformerModel(batch_norm=True).to(ctx.device)
    policy = api.policy("ModuleWrapPolicy")({TransformerEncoderLayer, TransformerDecoderLayer}) if recursive else None
    with warnings.catch_warnings():
        # The batch norm's own unit warns; that warning is checked in mp_batchnorm.
        warnings.simplefilter("ignore", UserWarning)
        return api.wrap(model, auto_wrap_policy=policy, mixed_precision=mp, **device_kwargs(ctx), **kwargs)


def full_precision_in_eval(ctx: RankContext, payload: dict[str, Any]) -> None:
    """In eval with FSDP_USE_FULL_PREC_IN_EVAL=1 the loss is full precision; in train it is low: the
    torch test's product (``cast_forward_inputs`` x full precision in eval) on the torch test's layout (FULL_SHARD,
    flat parameters), and each combination again under another strategy and use_orig_params."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
    others = [("SHARD_GRAD_OP", True), ("NO_SHARD", False), ("FULL_SHARD", True), ("NO_SHARD", True)]
    combos = list(itertools.product([True, False], [True, False]))
    runs = [(("FULL_SHARD", False), *combo) for combo in combos] + [(layout, *combo) for layout, combo in zip(others, combos)]
    for (name, orig), cast_inputs, use_full in runs:
        mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low, cast_forward_inputs=cast_inputs)
        with full_prec_in_eval(use_full):
            model = _transformer(api, mp, ctx, recursive=True, sharding_strategy=strategy(api, name), use_orig_params=orig)
        inp = _batch(model, ctx, step=0)
        loss = model.get_loss(inp, model(*inp))
        assert loss.dtype == low, (cast_inputs, use_full, loss.dtype)
        loss.backward()
        for pname, p in model.named_parameters():
            assert p.grad is None or p.grad.dtype == torch.float32, (pname, p.grad.dtype)
        model.eval()
        inp = _batch(model, ctx, step=1)
        loss = model.get_loss(inp, model(*inp))
        want = torch.float32 if use_full else low
        assert loss.dtype == want, (name, orig, cast_inputs, use_full, loss.dtype)
        loss.backward()  # a backward in eval reduces in full precision too (checked in _comm)
        for pname, p in model.named_parameters():
            assert p.grad is None or p.grad.dtype == torch.float32, (pname, p.grad.dtype)
        # And back to low precision in train mode.
        model.train()
        loss = model.get_loss(inp, model(*inp))
        assert loss.dtype == low, ("train after eval", name, orig, cast_inputs, use_full, loss.dtype)
        loss.backward()


def full_precision_in_eval_buffers(ctx: RankContext, payload: dict[str, Any]) -> None:
    """In eval with full precision in eval, buffers are in their original dtype during and after
    forward, and back in the buffer dtype after a forward in train mode."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
    for cast_inputs, use_full in itertools.product([True, False], [True, False]):
        mp = api.MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low, cast_forward_inputs=cast_inputs)
        with full_prec_in_eval(use_full):
            torch.manual_seed(0)
            kwargs = dict(mixed_precision=mp, **device_kwargs(ctx))
            inner = api.wrap(PrecisionProbe(torch.float32, "buffer0", run_checks=False).to(ctx.device), **kwargs)
            model = api.wrap(nn.Sequential(inner, PrecisionProbe(torch.float32, "buffer1", run_checks=False).to(ctx.device)), **kwargs)
        inp = torch.randn(3, 10, device=ctx.device)
        model((inp, None))
        check_buffers(model, low, "train forward")
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
        check_buffers(model, eval_dtype, "after eval forward")
        model.train()
        model((inp, None))
        check_buffers(model, low, "train forward after eval")


def full_precision_in_eval_comm(ctx: RankContext, payload: dict[str, Any]) -> None:
    """In eval with full precision in eval, gradients are reduced in full precision."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
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
        inp = _batch(model, ctx, step=0)
        loss = model.get_loss(inp, model(*inp))
        with recorded("reduce_scatter") as reductions:
            loss.backward()
        want = torch.float32 if use_full else low
        assert reductions and reduced_dtypes(reductions) == {want}, (cast_inputs, use_full, reduced_dtypes(reductions))


# ---------------------------------------------------------------------------- train / EMA / eval
def train_ema_eval(ctx: RankContext, payload: dict[str, Any]) -> dict[str, list[float]]:
    """Train -> EMA update (inside summon_full_params) -> eval on the EMA model, three times per
    strategy: the eval outputs change every iteration (eval uses the updated EMA parameters)."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
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
