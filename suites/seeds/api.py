"""The parity helpers the seed checks share, per engine (``FSDPApi``, ``harness.fsdp1_api``).

The seed suites are conformance tests: every check takes an ``FSDPApi`` first and uses only its names,
so the same check runs on every engine with torch FSDP1's API that ``--engine`` selects; what the names
are and the documented differences between engines are ``harness.fsdp1_api``'s.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_tensors_match
from harness.fsdp1_api import FSDPApi, load_api
from harness.model_protocol import to_device, wrap_bottom_up
from harness.optim import sgd
from harness.references import all_rank_batch
from harness.tolerance import TolerancePolicy
from suites.engine.models import ENGINE_MODELS, singleton_groups

#: the seed checks take both from here, with the helpers below.
__all__ = ["FSDPApi", "load_api"]

# ---------------------------------------------------------------------------------------------------
# Parity helpers, engine-neutral (suites/engine/parity.py binds them to the builtin engine)

LR = 0.05
MOMENTUM = 0.9


def optim(params: Any) -> torch.optim.Optimizer:
    """The harness's parity optimizer (``harness.optim.sgd``) at the seed checks' ``LR`` and ``MOMENTUM``."""
    return sgd(params, LR, MOMENTUM)


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full_params(api: FSDPApi, model: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's full parameters by clean name (cloned inside summon_full_params)."""
    with api.FSDP.summon_full_params(model):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def assert_match(name: str, actual: torch.Tensor, expected: torch.Tensor, context: str) -> None:
    """``actual`` against ``expected`` under the harness's tolerance for their dtype (torch's defaults:
    what a full-precision generated case at two ranks is held to), failing with the harness's message."""
    assert_tensors_match(name, actual, expected, TolerancePolicy.for_dtype(expected.dtype), context)


def assert_params_match(api: FSDPApi, model: nn.Module, ref: nn.Module, context: str) -> None:
    got = full_params(api, model)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert sorted(got) == sorted(want), f"{context}: parameter names differ: {sorted(got)} vs {sorted(want)}"
    for name in want:
        assert_match(f"param:{name}", got[name].to(want[name].device), want[name], context)


def all_data(cls: Any, step: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every rank's batch of engine model ``cls`` at ``step``, for the local reference (``harness.references``)."""
    return all_rank_batch(lambda s, r: cls.get_input(step=s, rank=r), step, world, device)


def train_parity(
    api: FSDPApi, model_name: str, fsdp_kwargs: dict[str, Any], device: torch.device, reference: str = "ddp", steps: int = 4,
    wrap: Callable[..., nn.Module] | None = None,
) -> None:
    """Train the wrapped model and its reference; compare losses every step, full parameters at the end.

    ``ddp``: torch DDP on the same per-rank batches; ``local``: one unsharded copy seeing every rank's
    batch. The mixture of experts is compared with the unwrapped model and its declared reduction
    (its experts differ per rank, DDP would average them). ``wrap`` replaces ``api.wrap`` for every unit
    (e.g. to put checkpoint wrappers inside or around units).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cls = ENGINE_MODELS[model_name]
    context = f"{api.name} {model_name} {reference} {fsdp_kwargs}"
    if model_name == "engine_moe":
        ref = cls(rank, device)
        model = wrap_bottom_up(cls(rank, device), api.wrap, functools.partial(api.wrap, process_group=singleton_groups()),
                               **fsdp_kwargs)
        reference = "declared"
    else:
        ref = cls(device)
        model = wrap_bottom_up(cls(device), wrap or api.wrap, **fsdp_kwargs)
    ref_model: nn.Module = DDP(ref) if reference == "ddp" else ref
    opt, ref_opt = optim(model.parameters()), optim(ref.parameters())
    for step in range(steps):
        inputs = to_device(cls.get_input(step=step, rank=rank), device)
        loss = cls.get_loss(inputs, model(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if reference == "local":
            all_inputs = all_data(cls, step, world, device)
            ref_loss = cls.get_loss(all_inputs, ref_model(*all_inputs))
            ref_loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            assert_match(f"loss@{step}", mean_loss, ref_loss.detach(), context)
        else:
            ref_loss = cls.get_loss(inputs, ref_model(*inputs))
            ref_loss.backward()
            if model_name == "engine_moe":
                ref.reduce_reference_grads()
            assert_match(f"loss@{step}", loss.detach(), ref_loss.detach(), context)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_match(api, model, ref, context)


def accumulation_parity(
    api: FSDPApi, model_name: str, fsdp_kwargs: dict[str, Any], device: torch.device, use_no_sync: bool, micro_steps: int = 2
) -> None:
    """Accumulate ``micro_steps`` backwards per optimizer step, the first ones inside ``no_sync()``;
    compare with the local reference accumulating the same micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls = ENGINE_MODELS[model_name]
    ref = cls(device)
    model = wrap_bottom_up(cls(device), api.wrap, **fsdp_kwargs)
    opt, ref_opt = optim(model.parameters()), optim(ref.parameters())
    context = f"{api.name} {model_name} no_sync={use_no_sync} {fsdp_kwargs}"
    for step in range(3):
        for micro in range(micro_steps):
            inputs = to_device(cls.get_input(step=10 * step + micro, rank=rank), device)
            if use_no_sync and micro < micro_steps - 1:
                with model.no_sync():
                    cls.get_loss(inputs, model(*inputs)).backward()
            else:
                cls.get_loss(inputs, model(*inputs)).backward()
            all_inputs = all_data(cls, 10 * step + micro, world, device)
            cls.get_loss(all_inputs, ref(*all_inputs)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_params_match(api, model, ref, context)


Check = Callable[[FSDPApi, int, int], None]
