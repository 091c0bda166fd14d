"""Training parity of the engine against unsharded references, run inside rank processes.

Two references, as the issue asks:
- ``local``: one unsharded copy of the model on every rank that sees *every* rank's batch (the
  concatenation); its loss must equal the mean of the ranks' losses and its parameters the
  wrapped model's full parameters;
- ``ddp``: torch ``DistributedDataParallel`` on the same per-rank batches; the per-rank losses
  must match.
The mixture of experts is compared against the unwrapped model with its declared reduction
(:meth:`MixtureOfExperts.reduce_reference_grads`), per rank.

Optimizer: SGD with momentum (Adam's normalization would hide a gradient scaled by a constant).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from engine import FSDP
from suites.engine.models import MixtureOfExperts, NestedWrapped, SharedTransformer, singleton_groups

MODELS = {"nested": NestedWrapped, "transformer": SharedTransformer, "moe": MixtureOfExperts}
LR = 0.05
MOMENTUM = 0.9


def _optim(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's full parameters by clean name (cloned inside summon_full_params)."""
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_match(model: nn.Module, ref: nn.Module, context: str) -> None:
    got = full_params(model)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert sorted(got) == sorted(want), f"{context}: parameter names differ: {sorted(got)} vs {sorted(want)}"
    for name in want:
        assert_close(got[name].to(want[name].device), want[name], msg=lambda m, n=name: f"{context}: {n}: {m}")


def train_parity(
    model_name: str,
    fsdp_kwargs: dict[str, Any],
    device: torch.device,
    reference: str = "local",
    steps: int = 5,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Train the wrapped model and its reference for ``steps`` steps; compare losses every step
    and full parameters at the end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls = MODELS[model_name]
    context = f"{model_name} {reference} {fsdp_kwargs}"
    if model_name == "moe":
        expert_group = singleton_groups()
        ref = cls(rank, device)
        model = cls(rank, device).wrap(FSDP, expert_group=expert_group, **fsdp_kwargs)
    else:
        ref = cls(device)
        model = cls(device).wrap(FSDP, **fsdp_kwargs)
    if model_name == "moe":
        # Its experts differ per rank: DDP would broadcast and average them.
        reference = "declared"
    ref_model: nn.Module = DDP(ref) if reference == "ddp" else ref
    opt, ref_opt = _optim(model.parameters()), _optim(ref.parameters())
    for step in range(steps):
        inputs = cls.input(step, rank, device)
        loss = cls.loss(model(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if reference == "local":
            every = [cls.input(step, r, device) for r in range(world)]
            cat = tuple(torch.cat(parts) for parts in zip(*every))
            ref_loss = cls.loss(ref_model(*cat))
            ref_loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            assert_close(mean_loss, ref_loss.detach(), msg=lambda m, s=step: f"{context}: step {s} loss: {m}")
        else:
            ref_loss = cls.loss(ref_model(*inputs))
            ref_loss.backward()
            if model_name == "moe":
                ref.reduce_reference_grads()
            assert_close(loss.detach(), ref_loss.detach(), msg=lambda m, s=step: f"{context}: step {s} loss: {m}")
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_match(model, ref, context)


def _all_data(cls: Any, step: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    every = [cls.input(step, r, device) for r in range(world)]
    return tuple(torch.cat(parts) for parts in zip(*every))


def accumulation_parity(
    model_name: str, fsdp_kwargs: dict[str, Any], device: torch.device, use_no_sync: bool, micro_steps: int = 2
) -> None:
    """Accumulate ``micro_steps`` backwards before each optimizer step, the first ones inside
    ``no_sync()`` (or all synced, without ``zero_grad`` in between); compare with the local
    reference accumulating the same micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls = MODELS[model_name]
    ref = cls(device)
    model = cls(device).wrap(FSDP, **fsdp_kwargs)
    opt, ref_opt = _optim(model.parameters()), _optim(ref.parameters())
    context = f"{model_name} no_sync={use_no_sync} {fsdp_kwargs}"
    for step in range(3):
        for micro in range(micro_steps):
            inputs = cls.input(10 * step + micro, rank, device)
            last = micro == micro_steps - 1
            if use_no_sync and not last:
                with model.no_sync():
                    cls.loss(model(*inputs)).backward()
            else:
                cls.loss(model(*inputs)).backward()
            cls.loss(ref(*_all_data(cls, 10 * step + micro, world, device))).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_params_match(model, ref, context)
