"""torch's own FSDP parity machinery (``torch.testing._internal.common_fsdp``) driven over an engine.

``FSDPTest._test_fsdp_parity`` trains torch's test models wrapped by the engine against DDP, with
torch's own checks (losses, parameters, the state dict round trip). It names torch FSDP1's classes
through ``common_fsdp``'s module globals; this module points those globals (``FSDP``, ``CPUOffload``,
the wrap helpers, ``ShardedGradScaler``) at the engine's, in this process and (through an environment
variable read at import) in every rank process ``FSDPTest`` spawns. One engine per run: the one
``--engine`` selects with torch FSDP1's API (``python -m harness certify`` passes exactly one).

GPU only (``FSDPTest`` runs one NCCL rank per GPU), and only where torch's testing extras import.
``python -m harness certify`` runs it as its ``torch-common-fsdp`` family (``pytest --pyargs
harness.conformance.torch_common_fsdp -p harness.pytest_plugin``, from an installed package too); the
suites collect it through ``suites/seeds/test_torch_common_fsdp.py`` (and ``certify``'s ``seeds`` family runs it
again, as that folder holds it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from harness.engines.fsdp1_api import FSDPApi, load_api
from harness.pytest_plugin import gpus_missing, needs_gpus
from harness.pytest_plugin.cases import ParityOptions
from harness.ranks.placement import n_gpus, place

# The first reason that holds, named as it is: without a GPU nothing here can run, whatever imports.
if (_no_gpu := gpus_missing(1)) is not None:
    pytest.skip(_no_gpu, allow_module_level=True)
try:
    import torch.testing._internal.common_fsdp as common_fsdp
except ImportError as _exc:  # the module's own words: which package is missing (expecttest, ...)
    pytest.skip(f"torch's testing extras do not import (torch.testing._internal.common_fsdp: {_exc})",
                allow_module_level=True)

#: what a collector of these checks imports: the test class, its fixture and its marks.
__all__ = ["TestTorchParityMachinery", "_engine", "pytestmark"]

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

#: the engine spec the rank processes patch ``common_fsdp`` with (they get no pytest options).
ENGINE_ENV = "FSDP_PARITY_COMMON_FSDP_ENGINE"
_PATCHED = ("FSDP", "CPUOffload", "ModuleWrapPolicy", "always_wrap_policy", "wrap", "enable_wrap", "ShardedGradScaler")
_ORIGINAL = {name: getattr(common_fsdp, name) for name in _PATCHED if hasattr(common_fsdp, name)}


def drive(api: FSDPApi) -> None:
    """Point ``common_fsdp``'s FSDP1 names at the engine's."""
    names: dict[str, Any] = {"FSDP": api.FSDP, "CPUOffload": api.CPUOffload, "ShardedGradScaler": api.ShardedGradScaler}
    for name in ("ModuleWrapPolicy", "always_wrap_policy", "wrap", "enable_wrap"):
        names[name] = api.policy(name)
    for name, value in names.items():
        if name in _ORIGINAL and value is not None:
            setattr(common_fsdp, name, value)


def _restore() -> None:
    for name, value in _ORIGINAL.items():
        setattr(common_fsdp, name, value)


if os.environ.get(ENGINE_ENV):
    drive(load_api(os.environ[ENGINE_ENV]))  # a rank process spawned by FSDPTest


@pytest.fixture(autouse=True, scope="module")
def _engine(parity_options: ParityOptions) -> Iterator[None]:
    engines = parity_options.fsdp1_engines
    if len(engines) != 1:
        pytest.skip(reason=f"torch's FSDPTest drives one engine per run; --engine names {list(engines)} with torch FSDP1's API")
    os.environ[ENGINE_ENV] = engines[0]
    drive(load_api(engines[0]))
    try:
        yield
    finally:
        os.environ.pop(ENGINE_ENV, None)
        _restore()


def _api() -> FSDPApi:
    return load_api(os.environ[ENGINE_ENV])


from torch.testing._internal.common_utils import set_rng_seed  # noqa: E402 - after the importorskip above

_DEVICE_INIT = getattr(common_fsdp, "DEVICEInitMode", None) or getattr(common_fsdp, "CUDAInitMode")
_DEVICE_BEFORE = getattr(_DEVICE_INIT, "DEVICE_BEFORE", None) or getattr(_DEVICE_INIT, "CUDA_BEFORE")


class TestTorchParityMachinery(common_fsdp.FSDPTest):
    """torch's parity checks, the engine in FSDP's place, on two ranks placed by the harness's rule: NCCL
    with one GPU per rank where there are two, gloo with both ranks on one GPU where there is one."""

    @property
    def world_size(self) -> int:
        return 2

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # torch's own _run exits as skipped below one GPU per rank and always asks for NCCL; this one
        # places the ranks as every pool of the harness is placed, then runs the test as torch's does.
        self = cls(test_name)
        self.rank, self.file_name = rank, file_name
        lane = place(self.world_size, n_gpus(), device="cuda")
        torch.cuda.set_device(lane.devices[rank])  # type: ignore[index]
        dist.init_process_group(init_method=self.init_method, backend=lane.backend,
                                world_size=self.world_size, rank=rank)
        dist.barrier()
        torch._dynamo.reset()
        set_rng_seed()
        self.run_test(test_name, pipe)
        torch._dynamo.reset()
        dist.barrier()
        dist.destroy_process_group()

    def _parity(self, model: Any, strategy: str, **kwargs: Any) -> None:
        api = _api()
        # torch's default reference is DDP on GPU ``rank``, which does not exist where ranks share a GPU.
        device = torch.cuda.current_device()
        self._test_fsdp_parity(
            model, common_fsdp.FSDPInitMode.RECURSIVE, _DEVICE_BEFORE,
            ref_init_fn=lambda m: DistributedDataParallel(m, device_ids=[device], output_device=device),
            sharding_strategy=getattr(api.ShardingStrategy, strategy), cpu_offload=api.CPUOffload(), **kwargs,
        )

    def test_nested_full_shard(self) -> None:
        self._parity(common_fsdp.NestedWrappedModule, "FULL_SHARD")

    def test_nested_shard_grad_op(self) -> None:
        self._parity(common_fsdp.NestedWrappedModule, "SHARD_GRAD_OP")

    def test_nested_no_shard(self) -> None:
        self._parity(common_fsdp.NestedWrappedModule, "NO_SHARD")

    def test_transformer_full_shard_prefetch(self) -> None:
        self._parity(common_fsdp.TransformerWithSharedParams, "FULL_SHARD",
                     backward_prefetch=_api().BackwardPrefetch.BACKWARD_PRE)

    def test_nested_full_shard_orig_params(self) -> None:
        self._parity(common_fsdp.NestedWrappedModule, "FULL_SHARD", use_orig_params=True)
