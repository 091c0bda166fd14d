"""The engine adapter for torch FSDP2's API (``fully_shard``), from torch or any namespace with
``fully_shard``, ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy`` (``NAME=fsdp2:MODULE``).

``fully_shard`` per unit, then on the root. FULL_SHARD and SHARD_GRAD_OP map to
``reshard_after_forward`` True/False, the hybrid strategies to a 2-D (replicate, shard) mesh; the
parameters are DTensors sharded on their first dimension, read back as ``ParamSlice``s of rows. The
interface it implements, and the FSDP1 adapter beside it, are in ``harness.engines.adapters``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch.nn as nn

from harness.cases.capabilities import Rule
from harness.cases.case import FSDP1_EXTRAS, CaseConfig, PrecisionSpec, is_hybrid
from harness.cases.dtypes import dtype_of
from harness.cases.models import ZooModel, wrap_bottom_up
from harness.engines.activation_checkpointing import apply_activation_checkpointing, checkpointed_units
from harness.engines.adapters import (
    EngineAdapter,
    EngineFacts,
    EngineTrainee,
    EngineUtilities,
    ParamSlice,
    ignored_option,
    canonical_name,
    has_float_buffers,
    module_version,
)
from harness.engines.dtensors import chunk_rows, full_tensor
from harness.ranks.placement import hybrid_shard_size
from harness.ranks.rank import RankContext

__all__ = ["FSDP2Adapter", "torch_fsdp2_api"]

_FSDP2_NAMES = ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy")

#: What ``fully_shard`` cannot express, whoever provides it.
FSDP2_RULES: tuple[Rule, ...] = (
    Rule(
        "fsdp2_has_no_flat_params",
        ("use_orig_params",),
        "FSDP2 has no flat parameters: it always exposes the original parameters (as DTensors), so "
        "use_orig_params=False does not exist there",
        lambda c: not c["use_orig_params"],
    ),
    Rule(
        "fsdp2_backward_prefetch",
        ("backward_prefetch",),
        "FSDP2 always prefetches the next all-gather before a module's backward (BACKWARD_PRE); it can "
        "neither turn that off nor prefetch after the gradient computation (BACKWARD_POST)",
        lambda c: c["backward_prefetch"] != "pre",
    ),
)


#: FSDP1's utilities ``fully_shard`` has no counterpart of (set_requires_gradient_sync is its own API).
FSDP2_MISSING_UTILITIES = {
    **dict.fromkeys(("summon", "summon_offload_to_cpu"), "fully_shard has no summon_full_params"),
    "no_sync": "fully_shard has no no_sync",
}


class FSDP2Adapter(EngineAdapter):
    """``fully_shard`` (FSDP2): torch's (``module_name=None``) or any namespace's with its API."""

    def __init__(self, name: str = "torch-fsdp2", module_name: str | None = None) -> None:
        self.name = name
        #: None: torch's own, from ``torch.distributed.fsdp`` (2.6+) or ``torch.distributed._composable.fsdp``.
        self.module_name = module_name

    def api(self) -> Any:
        """The namespace providing ``fully_shard`` and its policies; raises naming a missing name."""
        if self.module_name is None:
            return torch_fsdp2_api()
        module = importlib.import_module(self.module_name)
        missing = [n for n in _FSDP2_NAMES if not hasattr(module, n)]
        if missing:
            raise AttributeError(
                f"module {self.module_name!r} does not export {missing}; an FSDP2-API engine must export "
                f"{list(_FSDP2_NAMES)} at package level"
            )
        return module

    def check(self) -> None:
        self.api()

    def version(self) -> str:
        return module_version(self.module_name or "torch")

    def capability_rules(self) -> tuple[Rule, ...]:
        return FSDP2_RULES

    def unsupported_reason(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
        spec = case.precision_spec
        name = self.name
        if case.sharding_strategy == "no_shard":
            return f"{name}: fully_shard always shards; NO_SHARD has no equivalent (use DDP or replicate)"
        matrix_rule = self.unsupported(case)
        if matrix_rule is not None:
            return f"{name}: {matrix_rule}"
        if spec.buffer is not None and spec.buffer != spec.full and has_float_buffers(model):
            return f"{name}: MixedPrecisionPolicy has no buffer dtype; this model has floating buffers (buffer={spec.buffer})"
        if model.rank_local_modules() and is_hybrid(case.sharding_strategy):
            return f"{name}: rank-local modules on a one-rank mesh inside a 2-D hybrid mesh are not supported"
        if case.cpu_offload and case.clip_grad != "none" and ctx.backend == "nccl":
            # Measured on 4 GPUs (torch 2.11): clip_grad_norm_ all-reduces the offloaded gradients' norm on
            # the CPU through a functional collective, and an NCCL-only group refuses CPU tensors.
            return (f"{name}: clipping CPU-offloaded gradients all-reduces a CPU tensor, which an NCCL-only process "
                    "group refuses (torch expects init_process_group('cpu:gloo,cuda:nccl') with CPUOffloadPolicy)")
        fsdp1_only = sorted(k for k in FSDP1_EXTRAS if k in case.extra)
        if fsdp1_only:
            return f"{name}: extras {fsdp1_only} are FSDP1 constructor forms (harness.cases.case.FSDP1_EXTRAS)"
        return None

    def effective_precision(self, case: CaseConfig, model: ZooModel) -> PrecisionSpec:
        # FSDP2 leaves buffers alone (unsupported_reason refused models where that matters).
        return replace(case.precision_spec, buffer=None)

    def supports_prefetch_baseline(self, case: CaseConfig) -> bool:
        return False

    def build(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineTrainee:
        api = self.api()
        spec = case.precision_spec
        if is_hybrid(case.sharding_strategy):
            shard = hybrid_shard_size(case.extra, ctx.world_size, ctx.local_world_size)
            mesh = ctx.mesh((ctx.world_size // shard, shard), ("replicate", "shard"))
        else:
            mesh = ctx.mesh((ctx.world_size,), ("shard",))
        kwargs: dict[str, Any] = {
            "reshard_after_forward": case.sharding_strategy in ("full_shard", "hybrid_shard"),
        }
        ignored = ignored_option(case)
        if spec.is_mixed:
            fields = {"param_dtype": spec.param, "reduce_dtype": spec.reduce}
            kwargs["mp_policy"] = api.MixedPrecisionPolicy(**{k: None if k == ignored else dtype_of(v) for k, v in fields.items()})
        if case.cpu_offload:
            kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=ctx.device_type == "cuda")
        if ignored is not None:
            kwargs.pop(ignored, None)
        if case.init_mode == "before":
            model.to(ctx.device)
        # FSDP2 takes checkpointing before fully_shard (torch's own FSDP2 tests: CheckpointWrapper(layer),
        # then fully_shard on the layer).
        apply_activation_checkpointing(model, checkpointed_units(model), case.activation_checkpointing)
        wrap_bottom_up(model, lambda unit: api.fully_shard(unit, mesh=mesh, **kwargs),
                       lambda unit: api.fully_shard(unit, mesh=ctx.singleton_mesh(), **kwargs))
        if case.forward_prefetch and ignored != "forward_prefetch":
            # FSDP2 prefetches forward all-gathers only when told which module comes next (an FSDPModule's
            # method; a namespace without it leaves the knob unset, which the knob check then reports).
            order = [m for m in model.modules() if hasattr(m, "set_modules_to_forward_prefetch")]
            for current, following in zip(order, order[1:]):
                current.set_modules_to_forward_prefetch([following])
        if case.init_mode == "after" and not case.cpu_offload:
            model.to(ctx.device)
        return EngineTrainee(
            model, model,
            read_grads=lambda: _dtensor_slices(model, "grad"),
            read_params=lambda: _fsdp2_full_params(model),
            read_facts=lambda: EngineFacts(
                {p.to_local().device.type if hasattr(p, "to_local") else p.device.type for p in model.parameters()},
                None,
            ),
            utilities=EngineUtilities(missing=dict(FSDP2_MISSING_UTILITIES)),
            accumulate=lambda: _without_gradient_sync(model),
        )


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of ``no_sync``: ``set_requires_gradient_sync(False)`` on every FSDP module."""
    model.set_requires_gradient_sync(False, recurse=True)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True, recurse=True)  # type: ignore[operator]


def _dtensor_rows(p: Any) -> tuple[int, int]:
    """``(first row, rows)`` of dim 0 this rank's shard of a dim-0-sharded DTensor holds (torch.chunk)."""
    placements = p.placements
    mesh = p.device_mesh
    dim0 = p.shape[0]
    first, rows = 0, dim0
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard() and getattr(placement, "dim", 0) == 0:
            start, rows = chunk_rows(rows, mesh.size(mesh_dim), coordinate[mesh_dim])
            first += start
    return first, rows


def _dtensor_slices(model: nn.Module, kind: str) -> list[ParamSlice]:
    slices: list[ParamSlice] = []
    for name, p in model.named_parameters():
        tensor = p.grad if kind == "grad" else p
        if tensor is None:
            continue
        if not hasattr(tensor, "to_local"):
            slices.append(ParamSlice.full(canonical_name(name), tensor))
            continue
        local = tensor.to_local().detach().reshape(-1).cpu().clone()
        first_row, _ = _dtensor_rows(tensor)
        row_numel = math.prod(p.shape[1:])
        slices.append(ParamSlice(canonical_name(name), first_row * row_numel, local))
    return slices


def _fsdp2_full_params(model: nn.Module) -> list[ParamSlice]:
    out: list[ParamSlice] = []
    shards: list[ParamSlice] | None = None
    for name, p in model.named_parameters():
        if hasattr(p, "full_tensor") and p.to_local().device.type == p.device_mesh.device_type:
            # Plain all-gathers, not p.full_tensor(): functional collectives crash on gloo with CUDA tensors.
            out.append(ParamSlice.full(canonical_name(name), full_tensor(p)))
        else:
            # Offloaded shards live on CPU while the mesh is on the GPU: compare the shard itself.
            shards = _dtensor_slices(model, "param") if shards is None else shards
            out.extend(s for s in shards if s.name == canonical_name(name))
    return out


def torch_fsdp2_api() -> Any:
    """torch's FSDP2 namespace: ``torch.distributed.fsdp`` from 2.6 on, the composable one before."""
    try:
        from torch.distributed import fsdp as module

        module.fully_shard  # noqa: B018 - 2.6+ exports it here
    except (ImportError, AttributeError):
        from torch.distributed._composable import fsdp as module  # type: ignore[no-redef]
    return module
