"""The FSDP1 API of one engine: the names a conformance check uses, read from the engine's module.

A check that takes an ``FSDPApi`` first and uses only its names runs on every engine with torch FSDP1's
API that ``--engine`` selects: our engine (``builtin``: the ``engine`` package), torch FSDP1
(``torch-fsdp``: ``torch.distributed.fsdp``) and any plugged one (``NAME=fsdp1:MODULE`` or a registered
engine whose adapter has an ``fsdp1_module``; see ``harness.engines.registry``). The names are read from the
engine's module: the public ones at package level, the wrap policies from ``MODULE.wrap`` (or package
level), ``FlatParamHandle`` from ``MODULE.flat_param`` or ``MODULE._flat_param`` (None where it has
none: checks that need it fail, naming it) and ``ShardedGradScaler`` from package level or
``MODULE.sharded_grad_scaler``. The ``fsdp_api`` fixture of ``harness.pytest_plugin`` chooses the
engine and hands its spec, which the rank processes resolve again (``load_api``).

Documented differences by design (each check asserts each engine's own behaviour where they differ):

- torch FSDP1 refuses a CPU module without ``device_id`` when the rank sees no accelerator ("FSDP needs a
  non-CPU accelerator device"); our engine (and an engine built on it) computes on CPU by default. ``FSDPApi.wrap`` passes
  ``device_id=cpu`` to torch on such ranks, as a torch user on CPU must.
- torch FSDP1's CPU offload pins host memory, which needs an accelerator: offload checks skip on torch
  on CPU ranks (``FSDPApi.require_offload``) and run on ranks on the GPUs.

Each check runs where its rank is (``harness.ranks.rank.rank_device()``): the ported suites run their rank checks on CPU
ranks and again on the GPUs (``api_rank_check_tests(device=("cpu", "cuda"))``), sharing one where there are fewer
GPUs than ranks.

``harness.conformance.seeds.fsdp_differences`` asserts each engine's own side of both.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

from harness.ranks.rank import rank_device

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
    """The names of one FSDP1-API engine a ported check may use (pickled by name for the rank processes)."""

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


def no_shard_offload_race(engine: str, device: str, sharding: str, cpu_offload: bool, use_orig_params: bool) -> bool:
    """Whether a configuration is torch FSDP1's NO_SHARD + CPU offload + ``use_orig_params`` race on CUDA
    ranks (docs/gpus.md, known torch bugs): the optimizer step can read an offloaded gradient before its
    non-blocking copy to the host lands. Whether a run shows it depends on the GPU's load (a third to
    most of such cases fail in a night on one H100), so no expectation of it is stable; checks leave these
    configurations to ``suites/harness/test_stress.py``, which shows the race in every stressed run.
    ``engine`` is the engine's name (``torch-fsdp``), ``sharding`` the strategy's lower-case name."""
    return (engine == "torch-fsdp" and device == "cuda" and cpu_offload and sharding == "no_shard"
            and use_orig_params)


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
    from harness.engines.registry import resolve

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
