"""Rank-side jobs of ``test_wrap_engine.py``, run by :class:`harness.pool.RankPool`.

Module-level functions ``job(ctx, payload)`` (pickled by name). Each raises ``AssertionError``
naming every mismatch it found, and returns plain data for the parent to compare across ranks.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from wrap_models import FourLinears, nested_sequential

from engine import BackwardPrefetch, CPUOffload, FullyShardedDataParallel
from engine.wrap import size_based_auto_wrap_policy
from harness.pool import RankContext


def units_in_graph_order(wrapped: nn.Module) -> dict[str, nn.Module]:
    """The modules of a wrapped :class:`FourLinears` that the seed expects to be units."""
    inner = wrapped.module
    return {
        "lin1": inner.lin1,
        "lin2": inner.lin2,
        "lin3": inner.lin3,
        "lin4.nested_lin": getattr(inner.lin4, "module", inner.lin4).nested_lin,
        "lin4": inner.lin4,
        "<root>": wrapped,
    }


def _place(model: nn.Module, init_mode: str, device: torch.device) -> nn.Module:
    """``cuda_before``: on the GPU before wrapping; ``cpu`` and ``cuda_after``: on the CPU."""
    return model.to(device) if init_mode == "cuda_before" else model


def main_wrap_api(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """The seed's main wrap API: every module its own unit, then six SGD steps.

    Returns this rank's losses and those of an unsharded copy trained on the same input (every
    rank sees the same input, so the averaged gradient is the local one and the losses agree).
    The settings of each unit are checked in-process by ``test_main_wrap_api_settings``.
    """
    torch.manual_seed(0)
    model = _place(FourLinears(), cfg["init_mode"], ctx.device)
    reference = copy.deepcopy(model).to(ctx.device)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=0),  # every module
        cpu_offload=CPUOffload(offload_params=cfg["offload_params"]),
        backward_prefetch=BackwardPrefetch[cfg["backward_prefetch"]],
        forward_prefetch=cfg["forward_prefetch"],
    )
    if cfg["init_mode"] == "cuda_after":
        wrapped = wrapped.cuda()
    units = units_in_graph_order(wrapped)
    not_units = [name for name, module in units.items() if not isinstance(module, FullyShardedDataParallel)]
    if not_units:
        raise AssertionError(f"not wrapped as units: {not_units}")

    optim = torch.optim.SGD(wrapped.parameters(), lr=1e-2, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    inp = torch.ones(1, device=ctx.device)
    losses, ref_losses = [], []
    for _ in range(6):
        for net, opt, out in ((wrapped, optim, losses), (reference, ref_optim, ref_losses)):
            opt.zero_grad()
            loss = net(inp).sum()
            loss.backward()
            opt.step()
            out.append(loss.item())
    return {"losses": losses, "ref_losses": ref_losses}


def auto_wrap_smoke(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, float]:
    """The seed's auto-wrap smoke test on a one-rank default group: structure, forward, backward."""
    torch.manual_seed(0)
    sequential = _place(nested_sequential(), cfg["init_mode"], ctx.device)
    reference = copy.deepcopy(sequential).to(ctx.device)
    device_id = torch.device("cuda", torch.cuda.current_device()) if cfg["use_device_id"] else None
    model = FullyShardedDataParallel(
        sequential,
        cpu_offload=CPUOffload(offload_params=cfg["offload_params"]),
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=40),
        device_id=device_id,
    )
    inner = model.module
    layout = [type(inner[0]), type(inner[1]), type(inner[2])]
    expected = [nn.Linear, nn.Linear, FullyShardedDataParallel]
    if layout != expected or not all(isinstance(m, nn.Linear) for m in inner[2].module):
        raise AssertionError(f"wrapped layout {layout} (inner {list(inner[2].module)}), expected {expected}")
    if cfg["init_mode"] == "cuda_after":
        model = model.cuda()
    inp = torch.rand((1, 5), device=ctx.device)
    loss = F.mse_loss(inp, model(inp))
    loss.backward()
    return {"loss": loss.item(), "ref_loss": F.mse_loss(inp, reference(inp)).item()}


def mixed_precision_batchnorm(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """Linears in bfloat16 units, the batch norm between them in its own float32 unit.

    Returns the output dtype, the dtype the batch norm computed in, and the losses of a few steps.
    """
    from engine import MixedPrecision
    from engine.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).to(ctx.device)
    seen: dict[str, torch.dtype] = {}

    def record_bn_input(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        seen["bn_input"] = args[0].dtype

    # Registered before wrapping, so it runs before the float32 cast-back hook: sees the BN's own input.
    model[1].register_forward_hook(record_bn_input)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    torch.manual_seed(1 + ctx.rank)
    inp = torch.randn(8, 4, device=ctx.device)
    losses, out_dtype = [], None
    for _ in range(3):
        optim.zero_grad()
        out = wrapped(inp)
        out_dtype = out.dtype
        loss = out.float().pow(2).mean()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    units = [type(m.module).__name__ for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel)]
    return {"units": units, "bn_input": str(seen["bn_input"]), "output": str(out_dtype), "losses": losses}
