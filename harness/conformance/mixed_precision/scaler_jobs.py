"""Rank job of the sharded grad scaler: an inf in one rank's shard makes every rank skip and back off."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from harness.cases.dtypes import dtype_of
from harness.cases.models import gpu_sleep
from harness.conformance.fsdp1_checks import FSDPApi
from harness.conformance.mixed_precision.rank_api import device_kwargs, engine_api, grad_scaler_class
from harness.ranks.rank import RankContext


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
    low = dtype_of(payload.get("low"))
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
