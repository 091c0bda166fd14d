"""The FSDP1 API a seed check runs against, and the parity helpers the seeds share, per engine.

The seed suites are conformance tests: every check takes an ``FSDPApi`` first and uses only its names,
so the same check runs on every engine with torch FSDP1's API that ``--engine`` selects: our engine
(``builtin``: the ``engine`` package), torch FSDP1 (``torch-fsdp``: ``torch.distributed.fsdp``) and any
plugged one (``NAME=fsdp1:MODULE`` or a registered engine whose adapter has an ``fsdp1_module``; see
``harness.registry``). The names are read from the engine's module: the public ones at package level,
the wrap policies from ``MODULE.wrap`` (or package level), ``FlatParamHandle`` from ``MODULE.flat_param``
or ``MODULE._flat_param`` (None where it has none: checks that need it fail, naming it) and
``ShardedGradScaler`` from package level or ``MODULE.sharded_grad_scaler``. The ``fsdp_api`` fixture of
``harness.pytest_plugin`` chooses the engine and hands its spec, which the rank processes resolve again.

Documented differences by design (each check asserts each engine's own behaviour where they differ):

- torch FSDP1 refuses a CPU module without ``device_id`` when the rank sees no accelerator ("FSDP needs a
  non-CPU accelerator device"); our engine (and an engine built on it) computes on CPU by default. ``FSDPApi.wrap`` passes
  ``device_id=cpu`` to torch on such ranks, as a torch user on CPU must.
- torch FSDP1's CPU offload pins host memory, which needs an accelerator: offload checks skip on torch
  on CPU ranks (``FSDPApi.require_offload``) and run on ranks on the GPUs.

Each check runs where its rank is (``harness.rank.rank_device()``): the seed suites run their sessions on CPU
ranks and again on the GPUs (``api_session_tests(device=("cpu", "cuda"))``), sharing one where there are fewer
GPUs than ranks.

test_fsdp_differences.py asserts each engine's own side of both.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from harness.model_protocol import to_device, wrap_bottom_up
from harness.rank import rank_device
from suites.engine.models import ENGINE_MODELS, singleton_groups

__all__ = ["FSDPApi", "load_api"]

#: where a namespace keeps its wrap policies and its flat-parameter handle, besides package level.
_WRAP_MODULES = ("wrap",)
_FLAT_MODULES = ("flat_param", "_flat_param")
_SCALER_MODULES = ("sharded_grad_scaler",)
#: torch's own namespace: the documented differences of the module docstring are its.
_TORCH_FSDP1 = "torch.distributed.fsdp"

_PUBLIC = ("ShardingStrategy", "BackwardPrefetch", "CPUOffload", "MixedPrecision", "StateDictType")
_WRAP = (
    "ModuleWrapPolicy", "CustomPolicy", "always_wrap_policy", "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy", "enable_wrap", "wrap",
)


@dataclass(frozen=True)
class FSDPApi:
    """The names of one FSDP1-API engine a seed check may use (pickled by name for the rank processes)."""

    #: the engine's spec (``builtin``, ``mine=fsdp1:pkg``): what the rank processes resolve again.
    spec: str
    #: the engine's name, for messages.
    name: str
    #: the module the names come from.
    module: str
    #: ``FullyShardedDataParallel``: for ``isinstance`` and its static methods; construct with ``wrap``.
    FSDP: Any
    ShardingStrategy: Any
    BackwardPrefetch: Any
    CPUOffload: Any
    MixedPrecision: Any
    StateDictType: Any
    #: the engine's wrap module (policies, ``enable_wrap``/``wrap``).
    wrap_module: Any
    #: None where the engine exposes no flat-parameter handle.
    FlatParamHandle: Any
    HandleShardingStrategy: Any
    #: None where the engine has no ``ShardedGradScaler``.
    ShardedGradScaler: Any = None

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Travels to the rank processes as its spec: modules do not pickle, and each rank loads its own.
        return load_api, (self.spec,)

    @property
    def is_torch(self) -> bool:
        return self.module == _TORCH_FSDP1

    def policy(self, name: str) -> Any:
        """A name of the engine's wrap module (``ModuleWrapPolicy``, ``always_wrap_policy`` ...)."""
        return getattr(self.wrap_module, name)

    def device_kwargs(self) -> dict[str, Any]:
        """What a constructor call needs to run here: ``device_id=cpu`` for torch on a rank without a
        GPU (see the module docstring), nothing otherwise (both engines then take the current CUDA device)."""
        if self.is_torch and rank_device().type == "cpu":
            return {"device_id": torch.device("cpu")}
        return {}

    def wrap(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        """``FullyShardedDataParallel(module, **kwargs)`` plus ``device_kwargs()`` unless given."""
        return self.FSDP(module, **{**self.device_kwargs(), **kwargs})

    def require_offload(self, offload: bool) -> None:
        """Skip (on every rank alike, before any collective) where the engine cannot offload here."""
        if offload and self.is_torch and rank_device().type == "cpu":
            why = (
                "torch-fsdp: CPUOffload(offload_params=True) pins the offloaded shards' host memory, and on a rank "
                "without an accelerator Tensor.pin_memory() raises 'Cannot access accelerator device when none is available'"
            )
            pytest.skip(reason=why)

    def offloads(self) -> list[bool]:
        """The CPU-offload values this engine can run here."""
        return [False] if self.is_torch and rank_device().type == "cpu" else [False, True]


def _submodule(package: Any, names: Sequence[str]) -> list[Any]:
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(f"{package.__name__}.{name}"))
        except ModuleNotFoundError:
            continue
    return found


def _first(holders: Sequence[Any], name: str) -> Any:
    return next((getattr(h, name) for h in holders if hasattr(h, name)), None)


def load_api(spec: str) -> FSDPApi:
    """The FSDP1 API of the engine ``spec`` names (``builtin``, ``torch-fsdp``, ``mine=fsdp1:pkg`` ...)."""
    from harness.registry import resolve

    adapter = resolve(spec)
    if adapter.fsdp1_module is None:
        raise ValueError(f"fsdp_api={spec!r}: engine {adapter.name!r} does not have torch FSDP1's API (its adapter has no fsdp1_module)")
    package = importlib.import_module(adapter.fsdp1_module)
    wrap_holders = [*_submodule(package, _WRAP_MODULES), package]
    flat_holders = [*_submodule(package, _FLAT_MODULES), package]
    missing = [n for n in ("FullyShardedDataParallel", *_PUBLIC) if not hasattr(package, n)]
    missing += [f"wrap.{n}" for n in _WRAP if _first(wrap_holders, n) is None]
    if missing:
        raise AttributeError(f"engine {adapter.name!r}: {adapter.fsdp1_module} lacks {missing}: it does not have torch FSDP1's API")
    return FSDPApi(
        spec=spec,
        name=adapter.name,
        module=adapter.fsdp1_module,
        FSDP=package.FullyShardedDataParallel,
        **{n: getattr(package, n) for n in _PUBLIC},
        wrap_module=wrap_holders[0] if len(wrap_holders) > 1 else package,
        FlatParamHandle=_first(flat_holders, "FlatParamHandle"),
        HandleShardingStrategy=_first(flat_holders, "HandleShardingStrategy"),
        ShardedGradScaler=_first([package, *_submodule(package, _SCALER_MODULES)], "ShardedGradScaler"),
    )


# ---------------------------------------------------------------------------------------------------
# Parity helpers, engine-neutral (suites/engine/parity.py binds them to the builtin engine)

MODELS = ENGINE_MODELS
LR = 0.05
MOMENTUM = 0.9


def optim(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: Adam's normalization would hide a gradient scaled by a constant."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full_params(api: FSDPApi, model: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's full parameters by clean name (cloned inside summon_full_params)."""
    with api.FSDP.summon_full_params(model):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def assert_params_match(api: FSDPApi, model: nn.Module, ref: nn.Module, context: str) -> None:
    got = full_params(api, model)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert sorted(got) == sorted(want), f"{context}: parameter names differ: {sorted(got)} vs {sorted(want)}"
    for name in want:
        assert_close(got[name].to(want[name].device), want[name], msg=lambda m, n=name: f"{context}: {n}: {m}")


def _all_data(cls: Any, step: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    every = [to_device(cls.get_input(step=step, rank=r), device) for r in range(world)]
    return tuple(torch.cat(parts) for parts in zip(*every))


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
    cls = MODELS[model_name]
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
            all_inputs = _all_data(cls, step, world, device)
            ref_loss = cls.get_loss(all_inputs, ref_model(*all_inputs))
            ref_loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            assert_close(mean_loss, ref_loss.detach(), msg=lambda m, s=step: f"{context}: step {s} loss: {m}")
        else:
            ref_loss = cls.get_loss(inputs, ref_model(*inputs))
            ref_loss.backward()
            if model_name == "engine_moe":
                ref.reduce_reference_grads()
            assert_close(loss.detach(), ref_loss.detach(), msg=lambda m, s=step: f"{context}: step {s} loss: {m}")
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_match(api, model, ref, context)


def accumulation_parity(
    api: FSDPApi, model_name: str, fsdp_kwargs: dict[str, Any], device: torch.device, use_no_sync: bool, micro_steps: int = 2
) -> None:
    """Accumulate ``micro_steps`` backwards per optimizer step, the first ones inside ``no_sync()``;
    compare with the local reference accumulating the same micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls = MODELS[model_name]
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
            all_inputs = _all_data(cls, 10 * step + micro, world, device)
            cls.get_loss(all_inputs, ref(*all_inputs)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_params_match(api, model, ref, context)


Check = Callable[[FSDPApi, int, int], None]
