"""One interface over the engines under test and the references they are compared against.

An *engine adapter* turns a neutral ``CaseConfig`` into the engine's native options, wraps a zoo
model with them and hands back an ``EngineTrainee``: the wrapped module plus the engine-specific ways of
reading its gradients and parameters as ``ParamSlice`` s (pieces of the original parameters, by
canonical name and flat offset), so a shard of rank 1 is compared with exactly the elements of the
reference it claims to hold.

- ``FSDP1Adapter``: any engine with torch FSDP1's public API, parametrized by the namespace that
  provides ``FullyShardedDataParallel``, ``ShardingStrategy``, ``BackwardPrefetch``, ``CPUOffload``
  and ``MixedPrecision``: ``torch.distributed.fsdp`` for ``torch-fsdp``, the ``engine`` package for
  ``builtin``, any package for ``NAME=fsdp1:MODULE``. Units are wrapped by hand, bottom-up (only the
  constructor is needed, no wrap policy).
- ``FSDP2Adapter`` (``harness.engines.fsdp2_adapter``): ``fully_shard`` per unit, then on the root.

What an engine cannot express is declared by its adapter: ``capability_rules`` (combinations of axis
values the matrix leaves out, with the reason) and ``unsupported_reason`` (what only a rank can tell:
its device, the model). Which adapter a ``CaseConfig.engine`` names is ``harness.engines.registry``'s job.
The references (DDP and the local model) are in ``harness.engines.references``.
"""

from __future__ import annotations

import functools
import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from harness.cases.capabilities import Rule, first_reason
from harness.cases.case import FSDP1_PREFETCHES, FSDP1_STRATEGIES, FSDP_STRATEGIES, CaseConfig, PrecisionSpec, is_hybrid
from harness.cases.dtypes import dtype_of
from harness.cases.models import ZooModel, wrap_bottom_up
from harness.engines.activation_checkpointing import apply_activation_checkpointing, checkpointed_units
from harness.engines.owned_step import OwnedStep
from harness.ranks.placement import hybrid_shard_size
from harness.ranks.rank import RankContext

__all__ = [
    "EngineAdapter",
    "EngineUtilities",
    "FSDP1Adapter",
    "FSDP1Namespace",
    "ParamSlice",
    "EngineTrainee",
    "canonical_name",
    "fsdp1_mixed_precision",
    "fsdp1_options",
    "fsdp1_prefetch",
    "has_float_buffers",
    "rank_local_param_names",
]

#: ``torch.compile``'s ``OptimizedModule`` holds the compiled module as ``_orig_mod``.
_WRAPPER_SEGMENT = re.compile(r"^(_\w*wrapped_module|_orig_mod)$")


def canonical_name(name: str) -> str:
    """A parameter name with wrapper segments (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``,
    ``_orig_mod`` ...) removed, so engine and reference name a parameter alike."""
    return ".".join(part for part in name.split(".") if not _WRAPPER_SEGMENT.match(part))


@dataclass
class ParamSlice:
    """A contiguous piece of one original parameter, flattened: elements ``[start, start + numel)``."""

    name: str
    start: int
    #: 1-D, on CPU, detached.
    value: torch.Tensor

    @property
    def numel(self) -> int:
        return self.value.numel()

    @classmethod
    def full(cls, name: str, tensor: torch.Tensor) -> "ParamSlice":
        return cls(name, 0, tensor.detach().reshape(-1).cpu().clone())


@dataclass
class EngineFacts:
    """What an engine did with its parameters, for the knob checks."""

    #: device types the engine keeps its sharded parameters on.
    param_devices: set[str]
    #: True when ``module.parameters()`` yields flat parameters (FSDP1 with ``use_orig_params=False``);
    #: None when the notion does not apply.
    exposes_flat_params: bool | None


def has_float_buffers(model: nn.Module) -> bool:
    return any(b.is_floating_point() for b in model.buffers())


def rank_local_param_names(model: ZooModel) -> set[str]:
    local = {id(p) for m in model.rank_local_modules() for p in m.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in local}


def ignored_option(case: CaseConfig) -> str | None:
    """The engine option a ``("fault", "ignore_option:<name>")`` case tells the adapter to drop: a
    constructor keyword, or one field of the mixed-precision policy (``param_dtype``, ``reduce_dtype``,
    ``buffer_dtype``).

    Fault injection for the knob checks and the tolerance: an adapter that silently drops a setting
    must make the case fail.
    """
    fault = str(case.extra.get("fault", ""))
    return fault.split(":", 1)[1] if fault.startswith("ignore_option:") else None


# ---------------------------------------------------------------------------------------------------
# Engines


class EngineAdapter(ABC):
    """Maps a neutral case to one engine and wraps models with it.

    A plug-in engine subclasses this (or ``FSDP1Adapter``/``FSDP2Adapter``) and is named by a spec
    ``NAME=MODULE:OBJECT`` or an entry point of the group ``fsdp_parity.engines`` (``harness.engines.registry``).
    """

    #: the engine's name: case ids, reports and certificates show it.
    name: str
    #: the module with torch FSDP1's public API the engine is driven through, or None when it has none
    #: (the ported suites run on every engine that has one).
    fsdp1_module: str | None = None
    #: the strategies (``harness.cases.case.ShardingName``, by what they shard) this engine maps; the others are
    #: unsupported with the reason (``strategy_rule``). An engine declaring ZeRO-1/2 brings them onto the
    #: strategy axis of a selection that holds it (``harness.selection.matrix.resolve_axes``).
    strategies: tuple[str, ...] = FSDP_STRATEGIES
    #: True when the engine owns its training step (``harness.engines.owned_step``): its trainees carry ``owned``.
    owns_step: bool = False
    #: True when the engine computes gradients in an order of its own (DeepSpeed ZeRO-3's own linear
    #: backward and reduce-scatter of flat partitions): its cases are budgeted as cases that reorder sums
    #: (``harness.compare.tolerance.budget_source``), and Adam's null-gradient elements are held to its drift
    #: bound on any rank, as on CUDA ranks (``harness.compare.tolerance``).
    sums_in_own_order: bool = False

    def capability_rules(self) -> tuple[Rule, ...]:
        """Combinations of case axes (``CaseConfig`` fields, not ``engine``) this engine cannot express,
        each with the reason; the matrix leaves them out of every generator for this engine."""
        return ()

    def strategy_rule(self) -> Rule:
        """The strategies outside ``strategies``, with the reason: what this engine shards by."""
        mapped = self.strategies
        return Rule(
            "engine_strategies", ("sharding_strategy",),
            f"the engine maps only the strategies {', '.join(mapped)} (what it can shard)",
            lambda c: c["sharding_strategy"] not in mapped,
        )

    def all_rules(self) -> tuple[Rule, ...]:
        """``capability_rules`` and the strategy rule: every rule cases on this engine obey."""
        return (*self.capability_rules(), self.strategy_rule())

    def unsupported(self, values: Any) -> str | None:
        """Why the engine cannot express this case or mapping of axis values (every axis its rules
        read), or None: the first of its rules (``all_rules``) that matches."""
        mapping = values.to_dict() if isinstance(values, CaseConfig) else values
        return first_reason(self.all_rules(), mapping)

    def checkpoint_kinds(self) -> tuple[str, ...] | None:
        """The checkpoint kinds (``CaseConfig.checkpoint``) an engine that owns its step saves and loads
        through its trainee's ``OwnedStep.save``/``load`` (``full``: the neutral full state dict); None:
        the harness's own FSDP1/FSDP2 checkpoint paths (``harness.engines.checkpoint``)."""
        return None

    def check(self) -> None:
        """Import what the engine needs and raise (naming the missing module or name) if it is not there;
        called once at start-up so a bad engine stops the run before anything runs."""

    def version(self) -> str:
        """The engine's version, for certificates: its module's ``__version__`` or package version."""
        return "unknown"

    @abstractmethod
    def unsupported_reason(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
        """Why the engine cannot run this case here (one line), or None."""

    def effective_precision(self, case: CaseConfig, model: ZooModel) -> PrecisionSpec:
        """The casts the engine actually makes for this case (what the local reference emulates)."""
        return case.precision_spec

    def supports_prefetch_baseline(self, case: CaseConfig) -> bool:
        """Whether ``backward_prefetch='none'`` can run, as the baseline a prefetch setting must differ from."""
        return True

    @abstractmethod
    def build(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> "EngineTrainee":
        """Wrap a fresh zoo model (float32, CPU) for this case on this rank."""


#: The utilities an ``EngineUtilities`` can hold, by the names its ``missing`` uses.
UTILITIES = ("summon", "summon_offload_to_cpu", "no_sync")


@dataclass
class EngineUtilities:
    """The FSDP1 utilities a user calls between steps, bound to one wrapped model (what the offload
    placement probe, ``harness.compare.offload_probe``, drives); each None where the engine has no such API,
    with the reason in ``missing``."""

    #: ``summon_full_params`` bound to the root, taking the keywords ``writeback`` and ``offload_to_cpu``.
    summon: Callable[..., AbstractContextManager[None]] | None = None
    #: whether ``summon(offload_to_cpu=True)`` may be asked of this model.
    summon_offload_to_cpu: bool = False
    #: ``no_sync()`` of the root.
    no_sync: Callable[[], AbstractContextManager[None]] | None = None
    #: ``UTILITIES`` entry -> why the engine cannot be asked it (one line each).
    missing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def none(cls, why: str) -> "EngineUtilities":
        """No utility at all, for ``why`` (a reference, an adapter that exposes none)."""
        return cls(missing=dict.fromkeys(UTILITIES, why))


@dataclass
class EngineTrainee:
    """A wrapped engine model with its readers."""

    module: nn.Module
    zoo: ZooModel
    read_grads: Callable[[], list[ParamSlice]]
    read_params: Callable[[], list[ParamSlice]]
    read_facts: Callable[[], EngineFacts]
    #: remarks for the record (e.g. parameters compared as shards for want of ``summon_full_params``).
    notes: list[str] = field(default_factory=list)
    #: the engine's between-step utilities; an adapter that says nothing exposes none.
    utilities: EngineUtilities = field(
        default_factory=lambda: EngineUtilities.none("the engine's adapter exposes no FSDP1 utilities")
    )
    #: the context in which a micro-batch accumulates its gradient without synchronizing it (FSDP1's
    #: ``no_sync``); None: ``utilities.no_sync``.
    accumulate: Callable[[], AbstractContextManager[Any]] | None = None
    #: ``clip_grad_norm_(max_norm)`` over every gradient the side holds, returning the total norm before
    #: clipping; None: ``torch.nn.utils.clip_grad_norm_`` over the trainable parameters (full gradients).
    clip: Callable[[float], Any] | None = None
    #: the engine's own training step (``harness.engines.owned_step``); None: the harness's optimizer steps it.
    owned: OwnedStep | None = None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``trainable_parameters`` with the canonical names the unwrapped model gives them (empty for a
        parameter it does not have, such as a flat parameter of the root)."""
        names = {id(p): canonical_name(n) for n, p in self.zoo.named_parameters()}
        return [(names.get(id(p), ""), p) for p in self.trainable_parameters()]

    def skip_sync(self) -> AbstractContextManager[Any]:
        """Enter the engine's gradient accumulation without synchronization; raises where it has none."""
        accumulate = self.accumulate or self.utilities.no_sync
        if accumulate is None:
            raise NotImplementedError(f"no_sync: {self.utilities.missing.get('no_sync', 'the engine has no no_sync')}")
        return accumulate()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to a total norm of ``max_norm`` the engine's way; the total norm before it."""
        if self.clip is not None:
            total = self.clip(max_norm)
        else:
            total = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)
        # FSDP2's norm is a DTensor over the mesh: its full value is the total norm.
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        return float(torch.as_tensor(total).detach().double().cpu())

    def grad_slices(self) -> list[ParamSlice]:
        return self.read_grads()

    def final_params(self) -> list[ParamSlice]:
        return self.read_params()

    def facts(self) -> EngineFacts:
        return self.read_facts()


@dataclass(frozen=True)
class FSDP1Namespace:
    """The five public names of an FSDP1-API engine."""

    FullyShardedDataParallel: Any
    ShardingStrategy: Any
    BackwardPrefetch: Any
    CPUOffload: Any
    MixedPrecision: Any

    @classmethod
    def load(cls, module_name: str) -> "FSDP1Namespace":
        module = importlib.import_module(module_name)
        names = [f for f in cls.__dataclass_fields__]
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise AttributeError(
                f"module {module_name!r} does not export {missing}; an FSDP1-API engine must export "
                f"{names} at package level"
            )
        return cls(**{n: getattr(module, n) for n in names})


#: What FSDP1's API cannot express, whoever implements it (torch's ``FullyShardedDataParallel`` docstring
#: and Dynamo's FSDP support).
FSDP1_RULES: tuple[Rule, ...] = (
    Rule(
        "fsdp1_named_optimizers_need_orig_params",
        ("optimizer", "use_orig_params"),
        "parameter groups with different hyperparameters, optimizers over disjoint parameters and frozen "
        "parameters beside trainable ones in a unit need use_orig_params=True (a FlatParameter is one "
        "optimizer parameter with one requires_grad)",
        lambda c: c["optimizer"] in ("adamw_groups", "two_optimizers") and not c["use_orig_params"],
    ),
    Rule(
        "fsdp1_compile_needs_orig_params",
        ("compile", "use_orig_params"),
        "torch.compile supports FSDP1 only with use_orig_params=True (Dynamo: 'Dynamo only supports FSDP with "
        "use_orig_params=True')",
        lambda c: c["compile"] != "none" and not c["use_orig_params"],
    ),
)

#: torch FSDP1's own limit: ``FullyShardedDataParallel``'s docstring says gradient accumulation outside
#: ``no_sync()`` with CPU offload is not supported (it uses the newly reduced gradient instead of adding it
#: to the existing one).
FSDP1_OFFLOAD_ACCUMULATION_RULE = Rule(
    "fsdp1_accumulation_with_offload",
    ("grad_accum", "cpu_offload"),
    "gradient accumulation outside no_sync() with CPU offload is documented unsupported (the newly reduced "
    "gradient replaces the accumulated one)",
    lambda c: c["grad_accum"] == "sync" and c["cpu_offload"],
)

def fsdp1_prefetch(ns: Any, name: str) -> Any:
    """The ``BackwardPrefetch`` member of FSDP1's API namespace ``ns`` that prefetch ``name`` means (None: none)."""
    member = FSDP1_PREFETCHES[name]
    return None if member is None else getattr(ns.BackwardPrefetch, member)


def fsdp1_options(ns: Any, case: CaseConfig) -> dict[str, Any]:
    """The keywords of FSDP1's API namespace ``ns`` for the case's strategy, prefetches, CPU offload and
    ``use_orig_params`` (what ``FSDP1Adapter.options`` adds to them depends on the rank and precision)."""
    return {
        "sharding_strategy": getattr(ns.ShardingStrategy, FSDP1_STRATEGIES[case.sharding_strategy]),
        "backward_prefetch": fsdp1_prefetch(ns, case.backward_prefetch),
        "forward_prefetch": case.forward_prefetch,
        "cpu_offload": ns.CPUOffload(offload_params=case.cpu_offload),
        "use_orig_params": case.use_orig_params,
    }


def fsdp1_mixed_precision(ns: Any, spec: PrecisionSpec, **overrides: Any) -> Any:
    """The ``MixedPrecision`` of FSDP1's API namespace ``ns`` that ``spec`` means; ``overrides`` replace keywords."""
    fields = {k: dtype_of(v) for k, v in spec.mixed_precision_kwargs().items()}
    return ns.MixedPrecision(**{**fields, **overrides})


class FSDP1Adapter(EngineAdapter):
    """An engine with torch FSDP1's public API, from the namespace ``module_name``."""

    def __init__(self, name: str, module_name: str, *, offload_needs_accelerator: bool = False,
                 offloaded_summon_needs_nccl: bool = False, accumulates_with_offload: bool = True) -> None:
        self.name = name
        self.module_name = module_name
        self.fsdp1_module = module_name
        #: torch FSDP1 pins the offloaded shards' host memory, which needs an accelerator.
        self.offload_needs_accelerator = offload_needs_accelerator
        #: torch FSDP1 with CPU offload breaks its next all-gather after ``summon_full_params(offload_to_cpu=True)``
        #: on gloo with CUDA tensors (ranks sharing a GPU): suites/harness/test_shared_gpu_limits.py.
        self.offloaded_summon_needs_nccl = offloaded_summon_needs_nccl
        #: False for torch FSDP1 (``FSDP1_OFFLOAD_ACCUMULATION_RULE``).
        self.accumulates_with_offload = accumulates_with_offload
        self._ns: FSDP1Namespace | None = None

    def capability_rules(self) -> tuple[Rule, ...]:
        return FSDP1_RULES + (() if self.accumulates_with_offload else (FSDP1_OFFLOAD_ACCUMULATION_RULE,))

    @property
    def ns(self) -> FSDP1Namespace:
        if self._ns is None:
            self._ns = FSDP1Namespace.load(self.module_name)
        return self._ns

    def check(self) -> None:
        self.ns  # noqa: B018 - loads and checks the namespace

    def version(self) -> str:
        return module_version(self.module_name)

    def unsupported_reason(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
        self.ns  # an engine that cannot be imported is an error, not unsupported: raise here
        rule = self.unsupported(case)
        if rule is not None:
            return f"{self.name}: {rule}"
        if case.cpu_offload and self.offload_needs_accelerator and ctx.device_type == "cpu":
            return f"{self.name}: CPU offload pins host memory, which needs an accelerator; this rank runs on CPU"
        return None

    def options(self, case: CaseConfig, ctx: RankContext) -> dict[str, Any]:
        """The constructor keywords every unit shares (the process group is chosen per unit)."""
        ns = self.ns
        spec = case.precision_spec
        kwargs = fsdp1_options(ns, case)
        ignored = ignored_option(case)
        if spec.is_mixed:
            dropped = {ignored: None} if ignored in spec.mixed_precision_kwargs() else {}
            kwargs["mixed_precision"] = fsdp1_mixed_precision(ns, spec, **dropped)
        # FSDP1 refuses CPU modules without a device_id on CPU-only hosts; "never" leaves the move to it.
        if ctx.device_type == "cpu" or case.init_mode == "never":
            kwargs["device_id"] = ctx.device
        if ignored is not None:
            kwargs.pop(ignored, None)
        return kwargs

    def build(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineTrainee:
        ns = self.ns
        fsdp = ns.FullyShardedDataParallel
        kwargs = self.options(case, ctx)
        groups: dict[str, Any] = {"process_group": ctx.world_group()}
        if is_hybrid(case.sharding_strategy):
            shard = hybrid_shard_size(case.extra, ctx.world_size, ctx.local_world_size)
            groups = ({"device_mesh": ctx.mesh((ctx.world_size // shard, shard), ("replicate", "shard"))}
                      if case.extra.get("hybrid_groups") == "mesh" else {"process_group": ctx.hybrid_groups(shard)})
        if case.init_mode == "before":
            model.to(ctx.device)
        # A rank-local unit: a one-rank group, nothing to shard or reduce.
        local_kwargs = {**kwargs, "sharding_strategy": ns.ShardingStrategy.NO_SHARD}
        checkpointed = checkpointed_units(model)
        wrapped: dict[int, nn.Module] = {}

        def wrap(unit: nn.Module, **unit_kwargs: Any) -> nn.Module:
            wrapped[id(unit)] = fsdp(unit, **unit_kwargs)
            return wrapped[id(unit)]

        root = wrap_bottom_up(model, lambda unit: wrap(unit, **groups, **kwargs),
                              lambda unit: wrap(unit, process_group=ctx.singleton_group(), **local_kwargs))
        # FSDP1 checkpoints inside its units, FSDP(CheckpointWrapper(layer)), applied after wrapping; or
        # around them, CheckpointWrapper(FSDP(layer)), where the case asks (``harness.cases.case.FSDP1_EXTRAS``).
        if case.extra.get("checkpoint_wrapper") == "around":
            checkpointed = [wrapped[id(unit)] for unit in checkpointed]
        apply_activation_checkpointing(root, checkpointed, case.activation_checkpointing)
        if case.init_mode == "after":
            root.to(ctx.device)
        notes: list[str] = []
        return EngineTrainee(
            root, model,
            read_grads=lambda: _fsdp1_slices(root, "grad", case.use_orig_params),
            read_params=lambda: self._final_params(root, notes),
            read_facts=lambda: _fsdp1_facts(root),
            notes=notes,
            utilities=self._utilities(root, case, model, ctx),
            clip=getattr(root, "clip_grad_norm_", None) or _no_clip(self.name),
        )

    def _utilities(self, root: nn.Module, case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineUtilities:
        summon = getattr(self.ns.FullyShardedDataParallel, "summon_full_params", None)
        no_sync = getattr(root, "no_sync", None)
        missing = {} if summon is not None else dict.fromkeys(("summon", "summon_offload_to_cpu"), f"{self.name} has no summon_full_params")
        # FSDP1 raises NotImplementedError for offload_to_cpu=True where a unit does not shard: NO_SHARD,
        # any non-hybrid strategy on one rank (FSDP1 switches to NO_SHARD there), rank-local units.
        if summon is not None and (case.sharding_strategy == "no_shard" or model.rank_local_modules()
                                   or (ctx.world_size == 1 and not is_hybrid(case.sharding_strategy))):
            missing["summon_offload_to_cpu"] = "FSDP1's summon_full_params refuses offload_to_cpu=True where a unit runs NO_SHARD"
        if (summon is not None and self.offloaded_summon_needs_nccl and case.cpu_offload and ctx.device_type == "cuda"
                and ctx.backend == "gloo" and "summon_offload_to_cpu" not in missing):
            missing["summon_offload_to_cpu"] = (
                f"{self.name} with CPU offload fails its next all-gather after summon_full_params(offload_to_cpu=True) on "
                "gloo with CUDA tensors, as ranks sharing a GPU run ('Output 0 of SplitBackward0 is a view and is being "
                "modified inplace'); observed with one GPU per rank (NCCL)")
        if no_sync is None:
            missing["no_sync"] = f"{self.name} has no no_sync"
        return EngineUtilities(None if summon is None else functools.partial(summon, root),
                               "summon_offload_to_cpu" not in missing, no_sync, missing)

    def _final_params(self, root: nn.Module, notes: list[str]) -> list[ParamSlice]:
        summon = getattr(self.ns.FullyShardedDataParallel, "summon_full_params", None)
        if summon is None:
            notes.append("parameters compared as shards: the engine has no summon_full_params")
            return _fsdp1_slices(root, "param")
        with summon(root, writeback=False):
            return [ParamSlice.full(canonical_name(n), p) for n, p in root.named_parameters()]


def _flat_params(root: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(prefix, flat parameter)`` of every unit, duck-typed on FSDP1's ``_fqns`` and ``_shard_param_infos``.

    A unit's flat parameter is found registered on a module, in a module attribute, or one or two
    attributes deep (``_handle.flat_param`` in torch, a unit object's ``handle.flat_param``): with
    ``use_orig_params=True`` it is not registered. ``_fqns`` are relative to the wrapped module, whose
    path is ``prefix`` up to wrapper segments, which ``canonical_name`` removes.
    """
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def is_flat(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and hasattr(t, "_fqns") and hasattr(t, "_shard_param_infos")

    def candidates(module: nn.Module) -> Iterator[Any]:
        yield from module._parameters.values()
        # FSDP1's ``_handle`` (an attribute in torch, a property elsewhere) holds the unit's flat parameter.
        yield getattr(getattr(module, "_handle", None), "flat_param", None)
        for value in vars(module).values():
            if isinstance(value, (nn.Module, dict, list, tuple)) or value is None:
                continue
            yield value
            holder = getattr(value, "handle", None)
            yield getattr(value, "flat_param", None)
            if holder is not None:
                yield getattr(holder, "flat_param", None)

    for name, module in root.named_modules():
        for flat in candidates(module):
            if is_flat(flat) and id(flat) not in seen:
                seen.add(id(flat))
                found.append((name, flat))
    return found


def _fsdp1_slices(root: nn.Module, kind: str, use_orig_params: bool = False) -> list[ParamSlice]:
    """This rank's pieces of every original parameter (``kind="param"``) or gradient (``"grad"``).

    The flat parameters' shard metadata says which elements of which original parameter the local
    shard holds. Gradients are read where the optimizer reads them: the flat parameter's ``.grad``,
    or with ``use_orig_params=True`` each original parameter's ``.grad`` (a view of its piece).
    """
    originals = {canonical_name(n): p for n, p in root.named_parameters()} if use_orig_params else {}
    slices: list[ParamSlice] = []
    for prefix, flat in _flat_params(root):
        data = flat.grad if kind == "grad" else flat.detach()
        data = None if data is None else data.detach().reshape(-1).cpu()
        for fqn, info in zip(flat._fqns, flat._shard_param_infos):
            if not info.in_shard or not info.numel_in_shard:
                continue
            name = canonical_name(f"{prefix}.{fqn}" if prefix else fqn)
            start, numel = int(info.intra_param_start_idx), int(info.numel_in_shard)
            if kind == "grad" and use_orig_params:
                grad = getattr(originals.get(name), "grad", None)
                if grad is None:
                    continue
                grad = grad.detach().reshape(-1).cpu()
                # A sharded view holds just the piece; an unsharded one (NO_SHARD) the whole parameter.
                piece = grad if grad.numel() == numel else grad[start : start + numel]
            elif data is None:
                continue
            else:
                piece = data[info.offset_in_shard : info.offset_in_shard + numel]
            slices.append(ParamSlice(name, start, piece.clone()))
    return slices


def _no_clip(engine: str) -> Callable[[float], Any]:
    """A clip for an FSDP1-API engine without ``clip_grad_norm_``: torch's own over its shards would clip
    by a local norm, so a clipping case raises naming what is missing."""

    def clip(max_norm: float) -> Any:
        raise NotImplementedError(f"{engine}: its FullyShardedDataParallel has no clip_grad_norm_ (clip_grad='norm' needs it)")

    return clip


def _fsdp1_facts(root: nn.Module) -> EngineFacts:
    flats = _flat_params(root)
    registered = {id(p) for p in root.parameters()}
    return EngineFacts(
        param_devices={flat.device.type for _, flat in flats},
        exposes_flat_params=any(id(flat) in registered for _, flat in flats) if flats else None,
    )


def module_version(module_name: str) -> str:
    """``__version__`` of the module or of its top package, else its distribution's version, else ``unknown``."""
    from importlib import metadata

    top = module_name.split(".")[0]
    for name in dict.fromkeys((module_name, top)):
        try:
            version = getattr(importlib.import_module(name), "__version__", None)
        except ImportError:
            version = None
        if version:
            return str(version)
    try:
        return metadata.version(top)
    except metadata.PackageNotFoundError:
        return "unknown"
