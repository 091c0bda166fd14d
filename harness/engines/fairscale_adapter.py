"""FairScale's ``FullyShardedDataParallel`` (``fairscale.nn``), the FSDP1 ancestor with an API of its own:
CUDA and NCCL only (it builds CUDA streams when it first runs).

Registered as ``fairscale``. The harness trains it like the FSDP1 engines (its optimizer over the engine's
flat parameters, ``loss.backward()``, ``clip_grad_norm_`` and ``no_sync`` of the root); what differs is the
API and the flat-parameter layout, which the harness's FSDP1 readers (torch's ``_fqns`` and
``_shard_param_infos``) do not know:

- Strategies by what they shard: ``reshard_after_forward=True`` is ``full_shard``, ``False``
  ``shard_grad_op``; units wrapped bottom-up by hand, as for the FSDP1 engines.
- Readers: every unit holds one ``FlatParameter`` (``flatten_parameters=True``) whose ``metadata()`` names
  its original parameters and their sizes, in order; FairScale shards it with ``torch.chunk`` over the world,
  every shard padded to the first chunk's size. So rank ``r``'s shard starts at ``r`` x its size, and
  ``flat_param_slices`` (a pure function over that metadata) turns a shard, of the parameter or of its
  gradient, into pieces of the original parameters by name. No collective: each rank gives its own pieces.
- Mixed precision: ``mixed_precision=True`` with ``compute_dtype`` and ``buffer_dtype``, gradients reduced in
  the compute dtype, or in float32 with ``fp32_reduce_scatter``; other reduce dtypes are not expressible.
  FairScale 0.4.13 casts the root's inputs with ``.half()`` whatever ``compute_dtype`` says, so ``bf16``
  (bfloat16 parameters, float16 inputs) fails: an engine bug, a strict expected failure where it runs.
- Checkpoints: none mapped (its full optimizer state is keyed by its own flat parameter ids).

Without ``fairscale`` installed (``pip install -e .[fairscale]``), or on ranks without CUDA and NCCL, every
case is ``unsupported`` with that one line.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from harness.cases.capabilities import Rule, prefixed_rule
from harness.cases.case import PRECISIONS, CaseConfig, PrecisionSpec
from harness.cases.dtypes import dtype_of
from harness.cases.models import ZooModel, wrap_bottom_up
from harness.engines.activation_checkpointing import apply_activation_checkpointing, checkpointed_units
from harness.engines.adapters import (EngineAdapter, EngineFacts, EngineTrainee, EngineUtilities, ParamSlice, canonical_name,
                                      module_version)
from harness.ranks.rank import RankContext

__all__ = ["FAIRSCALE_RESHARD", "FAIRSCALE_RULES", "FairScaleAdapter", "fairscale_missing", "fairscale_name",
           "fairscale_precision", "flat_param_slices"]

#: strategy -> FairScale's ``reshard_after_forward``.
FAIRSCALE_RESHARD: dict[str, bool] = {"full_shard": True, "shard_grad_op": False}


def fairscale_missing() -> str | None:
    """Why FairScale cannot be used here (one line), or None when it is installed."""
    if importlib.util.find_spec("fairscale") is None:
        return ("fairscale is not installed: pip install -e .[fairscale] (an sdist: --no-build-isolation, with your "
                "torch pinned beside it)")
    return None


def fairscale_precision(spec: PrecisionSpec) -> dict[str, Any] | None:
    """FairScale's constructor keywords for ``spec`` as dtype names, or None where it cannot express it:
    float32 master parameters, gradients reduced in the compute dtype or (``fp32_reduce_scatter``) in float32."""
    if spec.full != "float32":
        return None
    if not spec.is_mixed:
        return {"mixed_precision": False}
    if spec.param is None or spec.reduced not in (spec.compute, "float32"):
        return None
    return {"mixed_precision": True, "compute_dtype": spec.param, "buffer_dtype": spec.buffer or spec.full,
            "fp32_reduce_scatter": spec.reduced == "float32" and spec.compute != "float32"}


def fairscale_name(prefix: str, name: str) -> str:
    """The canonical name of a FlatParameter's original parameter ``name`` in the unit at ``prefix``: FairScale's
    wrapper segments (``_fsdp_wrapped_module``, the flatten wrapper's ``_fpw_module``) removed."""
    full = f"{prefix}.{name}" if prefix else name
    return canonical_name(".".join(part for part in full.split(".") if part != "_fpw_module"))


def flat_param_slices(names: Sequence[str], numels: Sequence[int], shard_start: int, shard: torch.Tensor) -> list[ParamSlice]:
    """The pieces of the original parameters ``names`` (of ``numels`` elements, laid end to end in the flat
    parameter) that ``shard`` holds, the flat elements ``[shard_start, shard_start + shard.numel())``; the
    padding past the last parameter belongs to none."""
    if len(names) != len(numels):
        raise ValueError(f"flat_param_slices: {len(names)} names for {len(numels)} sizes; give one size per name")
    flat = shard.detach().reshape(-1)
    end = shard_start + flat.numel()
    slices: list[ParamSlice] = []
    offset = 0
    for name, numel in zip(names, numels):
        lo, hi = max(offset, shard_start), min(offset + numel, end)
        if lo < hi:
            slices.append(ParamSlice(name, lo - offset, flat[lo - shard_start : hi - shard_start].cpu().clone()))
        offset += numel
    return slices


def _units(root: nn.Module) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """``(prefix, FSDP instance, FlatParameter)`` of every FairScale unit under ``root``."""
    for prefix, module in root.named_modules():
        wrapper = getattr(module, "_fsdp_wrapped_module", None)
        for flat in getattr(wrapper, "flat_params", ()):
            yield prefix, module, flat


def _slices(root: nn.Module, kind: str) -> list[ParamSlice]:
    """This rank's pieces of every original parameter (``kind="param"``) or gradient (``"grad"``)."""
    out: list[ParamSlice] = []
    for prefix, unit, flat in _units(root):
        data = flat.grad if kind == "grad" else flat.detach()
        if data is None:
            continue
        names, _, numels = flat.metadata()
        start = unit.rank * data.numel() if getattr(flat, "_is_sharded", False) else 0
        out.extend(flat_param_slices([fairscale_name(prefix, n) for n in names], numels, start, data))
    return out


_rule = functools.partial(prefixed_rule, "fairscale")


#: What the FairScale adapter does not express, each with the reason.
FAIRSCALE_RULES: tuple[Rule, ...] = (
    _rule("precision", ("precision",),
          "FairScale's FSDP keeps float32 master parameters and reduces gradients in the compute dtype or, with "
          "fp32_reduce_scatter, in float32: no other reduce dtype, no fp64",
          lambda c: fairscale_precision(PRECISIONS[c["precision"]]) is None),
    _rule("prefetch", ("backward_prefetch", "forward_prefetch"),
          "FairScale's FSDP has no backward_prefetch or forward_prefetch setting",
          lambda c: c["backward_prefetch"] != "none" or c["forward_prefetch"]),
    _rule("offload", ("cpu_offload",),
          "FairScale's CPU offload (move_params_to_cpu, which needs mixed_precision) is not mapped by this adapter",
          lambda c: c["cpu_offload"]),
    _rule("orig_params", ("use_orig_params",),
          "FairScale's FSDP optimizes flat parameters (flatten_parameters=True) and has no use_orig_params",
          lambda c: c["use_orig_params"]),
    _rule("flat_optimizers", ("optimizer",),
          "parameter groups by name and optimizers over disjoint parameters need the original parameters; "
          "FairScale's FSDP exposes flat ones",
          lambda c: c["optimizer"] in ("adamw_groups", "two_optimizers")),
    _rule("init_mode", ("init_mode",),
          "FairScale's FSDP takes the module on its compute device (move_params_to_cpu is its offload): the "
          "module is moved before wrapping",
          lambda c: c["init_mode"] != "before"),
    _rule("compile", ("compile",),
          "torch.compile of FairScale's FSDP (its hooks and parameter swaps in forward) is not mapped",
          lambda c: c["compile"] != "none"),
    _rule("checkpoint", ("checkpoint",),
          "FairScale's full optimizer state (gather_full_optim_state_dict) is keyed by its own flat parameter "
          "ids: no checkpoint is mapped to the neutral one by this adapter",
          lambda c: c["checkpoint"] != "none"),
)


class FairScaleAdapter(EngineAdapter):
    """FairScale's ``FullyShardedDataParallel``, units wrapped bottom-up."""

    strategies = tuple(FAIRSCALE_RESHARD)

    def __init__(self, name: str) -> None:
        self.name = name

    def capability_rules(self) -> tuple[Rule, ...]:
        return FAIRSCALE_RULES

    def version(self) -> str:
        return module_version("fairscale") if fairscale_missing() is None else "not installed"

    def unsupported_reason(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
        reason = fairscale_missing() or self.unsupported(case)
        if reason is None and (ctx.device_type != "cuda" or ctx.backend != "nccl"):
            reason = (f"fairscale needs CUDA ranks over NCCL (its FSDP builds CUDA streams); this rank runs on "
                      f"{ctx.device_type} over {ctx.backend}")
        if reason is None and model.rank_local_modules():
            reason = "rank-local modules need a one-rank unit, which this adapter does not build for FairScale"
        return f"{self.name}: {reason}" if reason else None

    def build(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineTrainee:
        from fairscale.nn import FullyShardedDataParallel

        precision = fairscale_precision(case.precision_spec) or {}
        kwargs: dict[str, Any] = {
            "process_group": ctx.world_group(),
            "reshard_after_forward": FAIRSCALE_RESHARD[case.sharding_strategy],
            "flatten_parameters": True,
            "compute_device": ctx.device,
            **{k: dtype_of(v) if k.endswith("_dtype") else v for k, v in precision.items()},
        }
        model.to(ctx.device)
        checkpointed = checkpointed_units(model)
        root = wrap_bottom_up(model, lambda unit: FullyShardedDataParallel(unit, **kwargs))
        # Inside the units, as for the FSDP1 engines: the checkpointed layers are the units' own modules.
        apply_activation_checkpointing(root, checkpointed, case.activation_checkpointing)
        return EngineTrainee(
            root, model,
            read_grads=lambda: _slices(root, "grad"),
            read_params=lambda: _slices(root, "param"),
            read_facts=lambda: EngineFacts({flat.device.type for _, _, flat in _units(root)}, True),
            utilities=EngineUtilities(no_sync=root.no_sync,
                                      missing={"summon": "the FairScale adapter maps no summon_full_params",
                                               "summon_offload_to_cpu": "FairScale's summon_full_params has no offload_to_cpu"}),
            clip=root.clip_grad_norm_,
        )
