"""Rank-side jobs of ``harness.conformance.wrap.wrap_engine``, run by :class:`harness.ranks.pool.RankPool`.

Module-level functions ``job(ctx, payload)`` (pickled by name). The payload names the engine
(``payload["engine"]``: ``builtin`` or ``torch-fsdp``); each job loads its FSDP1 API on the rank
(:func:`harness.conformance.fsdp1_checks.load_api`) and uses only torch FSDP1's public names from it, so one job is
the same user code on every engine. Each job raises ``AssertionError`` naming every mismatch it found,
and returns plain data for the parent to compare across ranks.

Init modes (the torch test's ``CUDAInitMode`` plus a CPU tier):

- ``cpu``: gloo ranks, the module on the CPU, ``device_id=cpu``. torch FSDP1 needs ``device_id=cpu``
  on every host: without it a CPU module's compute device is the accelerator's current device (and on
  a host without one the constructor refuses the module). Our engine takes the same argument.
- ``cuda_before``: the module on the rank's GPU before wrapping.
- ``cuda_after``: the module on the CPU at wrapping, ``.cuda()`` on the wrapper afterwards (without
  ``device_id`` both engines shard on the CPU; torch FSDP1 warns that this is slow, and re-reads its
  flat parameters' storage at lazy init, after the move).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.cases.case import CaseConfig
from harness.cases.models import build_model
from harness.conformance.fsdp1_checks import FSDPApi, assert_trains_like_local_reference, load_api
from harness.conformance.wrap.wrap_models import FOUR_LINEARS, nested_sequential
from harness.ranks.rank import RankContext

InitMode = Literal["cpu", "cuda_before", "cuda_after"]


def units_in_graph_order(api: FSDPApi, wrapped: nn.Module) -> dict[str, nn.Module]:
    """The modules of a wrapped :class:`FourLinears` that the torch test expects to be units."""
    inner = wrapped.module
    lin4 = inner.lin4
    return {
        "lin1": inner.lin1,
        "lin2": inner.lin2,
        "lin3": inner.lin3,
        "lin4.nested_lin": (lin4.module if isinstance(lin4, api.FSDP) else lin4).nested_lin,
        "lin4": lin4,
        "<root>": wrapped,
    }


def _place(model: nn.Module, init_mode: InitMode, device: torch.device) -> nn.Module:
    """``cuda_before``: on the GPU before wrapping; ``cpu`` and ``cuda_after``: on the CPU."""
    return model.to(device) if init_mode == "cuda_before" else model


def _cpu_lane(init_mode: InitMode) -> dict[str, Any]:
    """The CPU tier names its device (see the module docstring); the CUDA modes pass what the torch test passes."""
    return {"device_id": torch.device("cpu")} if init_mode == "cpu" else {}


#: how the main wrap API check trains: the case of its zoo model (six steps, as in the torch test), whose local
#: reference says what the parameters must be after them.
MAIN_WRAP_CASE = CaseConfig(engine="builtin", reference="local", model=FOUR_LINEARS, steps=6)


def main_wrap_api(ctx: RankContext, cfg: dict[str, Any]) -> None:
    """The torch test's main wrap API: every module its own unit, then six SGD steps.

    Checks that every module is a unit carrying the root's offload and prefetch settings, then trains
    the wrapped model the case's way (``MAIN_WRAP_CASE``: units the harness cannot build, from a
    size-based policy, under the torch test's init modes) and compares its parameters with the harness's local
    reference.
    """
    api = load_api(cfg["engine"])
    case = MAIN_WRAP_CASE
    model = _place(build_model(case.model, seed=case.seed), cfg["init_mode"], ctx.device)
    cpu_offload = api.CPUOffload(offload_params=cfg["offload_params"])
    prefetch = api.BackwardPrefetch[cfg["backward_prefetch"]]
    wrapped = api.FSDP(
        model,
        auto_wrap_policy=functools.partial(api.policy("size_based_auto_wrap_policy"), min_num_params=0),  # every module
        cpu_offload=cpu_offload,
        backward_prefetch=prefetch,
        forward_prefetch=cfg["forward_prefetch"],
        **_cpu_lane(cfg["init_mode"]),
    )
    if cfg["init_mode"] == "cuda_after":
        wrapped = wrapped.cuda()
    problems = []
    for name, unit in units_in_graph_order(api, wrapped).items():
        if not isinstance(unit, api.FSDP):
            problems.append(f"{name}: not a unit ({type(unit).__name__})")
            continue
        settings = (unit.cpu_offload, unit.backward_prefetch, unit.forward_prefetch)
        if settings != (cpu_offload, prefetch, cfg["forward_prefetch"]):
            problems.append(f"{name}: (cpu_offload, backward_prefetch, forward_prefetch) = {settings}")
    if problems:
        raise AssertionError(f"{api.name}: " + "; ".join(problems))

    assert_trains_like_local_reference(api, wrapped, model, case, ctx.device, f"main wrap API {cfg}")


def auto_wrap_smoke(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, float]:
    """The torch test's auto-wrap smoke test on a one-rank default group: structure, forward, backward."""
    api = load_api(cfg["engine"])
    torch.manual_seed(0)
    sequential = _place(nested_sequential(), cfg["init_mode"], ctx.device)
    reference = copy.deepcopy(sequential).to(ctx.device)
    device_kwargs = _cpu_lane(cfg["init_mode"])
    if cfg["use_device_id"]:
        # Explicit index, as the torch test passes it: FSDP1 warns on an index-less CUDA device and takes the current one.
        device_kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())}
    model = api.FSDP(
        sequential,
        cpu_offload=api.CPUOffload(offload_params=cfg["offload_params"]),
        auto_wrap_policy=functools.partial(api.policy("size_based_auto_wrap_policy"), min_num_params=40),
        **device_kwargs,
    )
    inner = model.module
    layout = [type(inner[0]), type(inner[1]), type(inner[2])]
    expected = [nn.Linear, nn.Linear, api.FSDP]
    if layout != expected or not all(isinstance(m, nn.Linear) for m in inner[2].module):
        raise AssertionError(
            f"{api.name}: wrapped layout {layout} (inner {list(inner[2].module)}), expected {expected}"
        )
    if cfg["init_mode"] == "cuda_after":
        model = model.cuda()
    inp = torch.rand((1, 5), device=ctx.device)
    loss = F.mse_loss(inp, model(inp))
    loss.backward()
    return {"loss": loss.item(), "ref_loss": F.mse_loss(inp, reference(inp)).item()}


def mixed_precision_batchnorm(ctx: RankContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """Linears in bfloat16 units, the batch norm between them in its own float32 unit.

    Returns the wrapped module of every unit, the output dtype, the dtype the batch norm computed in,
    and the losses of a few steps.
    """
    api = load_api(cfg["engine"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).to(ctx.device)
    seen: dict[str, torch.dtype] = {}

    def record_bn_input(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        seen["bn_input"] = args[0].dtype

    # A forward hook sees the arguments after every forward pre-hook (the unit's float32 cast) ran, and,
    # registered before wrapping, it runs before the hook that casts the output back.
    model[1].register_forward_hook(record_bn_input)
    wrapped = api.FSDP(
        model,
        auto_wrap_policy=api.policy("ModuleWrapPolicy")({nn.Linear}),
        mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        **({"device_id": ctx.device} if ctx.device.type == "cpu" else {}),
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
    units = [type(m.module).__name__ for m in wrapped.modules() if isinstance(m, api.FSDP)]
    return {"units": units, "bn_input": str(seen["bn_input"]), "output": str(out_dtype), "losses": losses}
