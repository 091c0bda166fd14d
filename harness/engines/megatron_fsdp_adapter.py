"""Megatron-FSDP (the standalone ``megatron_fsdp`` package) through its public ``fully_shard``: an engine that
owns its training step (``harness.engines.owned_step``), CUDA and NCCL only.

``megatron_fsdp.fully_shard(module, optimizer, ...)`` returns a new root module (``MegatronFSDP``, the zoo
model as its ``.module``) and the optimizer it extended in place: its ``step`` waits for the gradient
reductions, steps the distributed main weights and installs them into the module; its ``zero_grad`` also
zeroes Megatron-FSDP's gradient buffer. So the harness calls ``loss.backward()``, then that ``step`` and
``zero_grad``.

Registered as ``megatron-fsdp`` (``zero_dp_strategy`` 3, ``optim_grads_params``: parameters, gradients
and optimizer state sharded, ``full_shard``), ``megatron-fsdp-zero2`` (2, ``optim_grads``) and
``megatron-fsdp-zero1`` (1, ``optim``), and as the API kind ``NAME=megatron-fsdp:PATH.json``: a JSON object
whose keys override the adapter's ``fully_shard`` keywords (``{"zero_dp_strategy": 2,
"overlap_grad_reduce": false}``). Keys the adapter takes from the case (the module, optimizer, device, mesh
and units) are refused in one line.

Why the optimizer's first step is neutralised: ``fully_shard_optimizer`` steps the optimizer once over zero
gradients, at the optimizer's own hyperparameters, to build its state eagerly; with AdamW that decays every
weight once and starts Adam's step count at 1, so the first trained step would not be the reference's. The
adapter makes that step at ``lr`` 0 and ``weight_decay`` 0 and resets the step count (what
``harness.engines.optim.init_optimizer_state`` does for the FSDP engines), so a case compares training alone.

Readers: ``fully_shard`` swaps the module's parameters for DTensors of the distributed main weights, unevenly
sharded along dimension 0 (a rank's piece of a parameter may be empty, and then its ``.grad`` is None); the
adapter gathers each into a full tensor with the package's ``uneven_dtensor_to_full_tensor`` (collective, every
rank in the same order). Checkpoints: ``full`` only, the neutral full state dict, gathered and split the same
way; Megatron-FSDP's own sharded checkpoints are DCP over uneven DTensors, not mapped.

Without ``megatron_fsdp`` installed (``pip install -e .[megatron-fsdp]``), or on ranks without CUDA and NCCL,
every case of these engines is ``unsupported`` with that one line.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.capabilities import Rule, prefixed_rule
from harness.cases.case import CaseConfig
from harness.cases.models import ZooModel
from harness.engines.activation_checkpointing import apply_activation_checkpointing, checkpointed_units
from harness.engines.adapters import EngineAdapter, EngineFacts, EngineTrainee, ParamSlice, canonical_name, module_version
from harness.engines.checkpoint import agree_loaded
from harness.engines.optim import build_optimizers
from harness.engines.owned_step import NEUTRAL_FULL_FILE, OwnedStep, neutral_model_state, neutral_param_groups
from harness.engines.spec_files import read_json_object
from harness.ranks.rank import RankContext

__all__ = ["MEGATRON_FSDP_RULES", "MEGATRON_STRATEGIES", "MegatronFSDPAdapter", "megatron_fsdp_missing", "zero_dp_level"]

#: ``zero_dp_strategy`` -> the strategy (``harness.cases.case.ShardingName``) that shards what it shards.
MEGATRON_STRATEGIES: dict[int, str] = {0: "no_shard", 1: "zero1", 2: "zero2", 3: "full_shard"}
#: ``zero_dp_strategy``'s names in megatron_fsdp 0.6.1 (``fully_shard.ShardingStrategy``), by level.
_LEVEL_NAMES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
#: ``fully_shard`` keywords the adapter sets from the case and the rank: a config file may not override them.
_CASE_KEYWORDS = ("module", "optimizer", "device_mesh", "dp_shard_dim", "tp_dim", "device", "fsdp_unit_modules",
                  "mixed_precision_policy", "init_model_with_meta_device")
#: The mesh's dimension names: the data-parallel one over every rank and a trivial tensor-parallel one
#: (size 1), which ``fully_shard`` needs (``tp_dim``).
_DP_DIM, _TP_DIM = "dp_shard", "tp"


def megatron_fsdp_missing() -> str | None:
    """Why Megatron-FSDP cannot be used here (one line), or None when it is installed."""
    if importlib.util.find_spec("megatron_fsdp") is None:
        return "megatron_fsdp is not installed: pip install -e .[megatron-fsdp] (or pip install megatron-fsdp==0.6.1)"
    return None


def zero_dp_level(value: Any, where: str) -> int:
    """``zero_dp_strategy`` as its level 0-3 (an int or one of 0.6.1's names); ``ValueError`` naming ``where``."""
    if isinstance(value, str) and value in _LEVEL_NAMES:
        return _LEVEL_NAMES[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in MEGATRON_STRATEGIES:
        return value
    raise ValueError(f"{where}: zero_dp_strategy={value!r}; set it to 0-3 or one of {sorted(_LEVEL_NAMES)}")


_rule = functools.partial(prefixed_rule, "megatron_fsdp")


#: What the Megatron-FSDP adapters do not express, whatever the strategy, each with the reason.
MEGATRON_FSDP_RULES: tuple[Rule, ...] = (
    _rule("precision", ("precision",),
          "mixed precision is Megatron-FSDP's MixedPrecisionPolicy (main parameter and gradient dtypes), which "
          "this adapter does not map yet: fp32 only",
          lambda c: c["precision"] != "fp32"),
    _rule("prefetch", ("backward_prefetch", "forward_prefetch"),
          "Megatron-FSDP has no FSDP-style forward/backward prefetch setting (it overlaps its bucketed gathers "
          "by overlap_param_gather)",
          lambda c: c["backward_prefetch"] != "none" or c["forward_prefetch"]),
    _rule("offload", ("cpu_offload",),
          "Megatron-FSDP's fully_shard has no CPU offload of parameters",
          lambda c: c["cpu_offload"]),
    _rule("orig_params", ("use_orig_params",),
          "Megatron-FSDP keeps the module's original parameters (DTensors of its buffers, no flat-parameter "
          "view): only use_orig_params=True describes it",
          lambda c: not c["use_orig_params"]),
    _rule("init_after", ("init_mode",),
          "fully_shard moves the module to its device itself (device=); moving it afterwards is not its API",
          lambda c: c["init_mode"] == "after"),
    _rule("one_group", ("optimizer",),
          "fully_shard replaces the optimizer's parameter groups with one group of its distributed parameters at "
          "the optimizer's defaults: one optimizer of one group",
          lambda c: c["optimizer"] in ("adamw_groups", "two_optimizers")),
    _rule("clip", ("clip_grad",),
          "the standalone package has no clip of its unevenly sharded DTensor gradients (Megatron-LM's optimizer "
          "clips): not mapped",
          lambda c: c["clip_grad"] != "none"),
    _rule("accumulation", ("grad_accum",),
          "Megatron-FSDP accumulates by its own microbatch count (set_model_auto_sync, is_last_microbatch), and "
          "optim_grads(_params) reduce every micro-batch: not mapped to the no_sync/sync axis",
          lambda c: c["grad_accum"] != "none"),
    _rule("compile", ("compile",),
          "torch.compile of a MegatronFSDP module (its parameter swaps between forward and step) is not mapped",
          lambda c: c["compile"] != "none"),
)


def unit_classes(model: nn.Module) -> list[type[nn.Module]]:
    """The classes of the model's units, which is how ``fully_shard``'s ``fsdp_unit_modules`` names units."""
    return list(dict.fromkeys(type(unit) for unit in model.wrap_units()))


def units_by_class_reason(model: nn.Module) -> str | None:
    """Why Megatron-FSDP cannot take this model's units, or None. It picks units by class, outermost
    first (a unit inside a unit is not one of its own): the classes of the harness's units must pick
    exactly those modules, or the engine would shard other units than the case describes."""
    classes = tuple(unit_classes(model))
    wanted = {id(unit) for unit in model.wrap_units()}
    picked: set[int] = set()
    covered: set[int] = set()
    for module in model.modules():  # parents before their children
        if id(module) not in covered and isinstance(module, classes):
            picked.add(id(module))
            covered.update(id(m) for m in module.modules())
    if picked == wanted:
        return None
    names = ", ".join(sorted({c.__name__ for c in classes}))
    return (f"Megatron-FSDP picks units by class (fsdp_unit_modules), outermost first: the classes of this model's "
            f"units ({names}) pick {len(picked)} module(s), not its {len(wanted)} units (nested units, or units that "
            f"share a class with modules that are none)")


class MegatronFSDPAdapter(EngineAdapter):
    """Megatron-FSDP at one ``zero_dp_strategy`` (``level``) or as a user's keyword file (``config_path``)."""

    owns_step = True

    def __init__(self, name: str, *, level: int | None = None, config_path: str | None = None) -> None:
        self.name = name
        self.config_path = config_path
        self._level = 3 if level is None else level
        # Read now: a bad file stops the run before anything runs (``harness.engines.registry.resolve``).
        self._user = read_json_object(config_path, "megatron-fsdp") if config_path is not None else {}
        taken = sorted(set(self._user) & set(_CASE_KEYWORDS))
        if taken:
            raise ValueError(f"megatron-fsdp config {config_path!r}: {taken} come from the case and the rank; "
                             "remove them from the file")

    @functools.cached_property
    def keywords(self) -> dict[str, Any]:
        """The ``fully_shard`` keywords every case of this engine starts from: the strategy, the file's keys over it."""
        return {"zero_dp_strategy": self._level, **self._user}

    @property
    def level(self) -> int:
        where = f"config {self.config_path!r}" if self.config_path else f"engine {self.name!r}"
        return zero_dp_level(self.keywords["zero_dp_strategy"], where)

    @property
    def strategies(self) -> tuple[str, ...]:  # type: ignore[override]
        return (MEGATRON_STRATEGIES[self.level],)

    def capability_rules(self) -> tuple[Rule, ...]:
        return MEGATRON_FSDP_RULES

    def checkpoint_kinds(self) -> tuple[str, ...]:
        return ("full",)

    def check(self) -> None:
        self.level  # noqa: B018 - an unmapped strategy stops the run here
        if self._user and megatron_fsdp_missing() is None:
            import megatron_fsdp

            known = set(inspect.signature(megatron_fsdp.fully_shard).parameters)
            unknown = sorted(set(self._user) - known)
            if unknown:
                raise ValueError(f"megatron-fsdp config {self.config_path!r}: {unknown} are no keywords of "
                                 f"megatron_fsdp.fully_shard {module_version('megatron_fsdp')}; fix the file")

    def version(self) -> str:
        return module_version("megatron_fsdp") if megatron_fsdp_missing() is None else "not installed"

    def unsupported_reason(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
        reason = megatron_fsdp_missing() or self.unsupported(case)
        if reason is None and (ctx.device_type != "cuda" or ctx.backend != "nccl"):
            reason = (f"megatron-fsdp needs CUDA ranks over NCCL (its buffers and device mesh are CUDA only); "
                      f"this rank runs on {ctx.device_type} over {ctx.backend}")
        if reason is None and model.rank_local_modules():
            reason = "Megatron-FSDP reduces every parameter over the data-parallel group: no rank-local modules"
        if reason is None:
            reason = units_by_class_reason(model)
        return f"{self.name}: {reason}" if reason else None

    def build(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineTrainee:
        import megatron_fsdp

        if case.init_mode == "before":
            model.to(ctx.device)
        apply_activation_checkpointing(model, checkpointed_units(model), case.activation_checkpointing)
        named = [(canonical_name(n), p) for n, p in model.named_parameters()]
        (optimizer,) = build_optimizers(case, named)
        units = unit_classes(model)
        mesh = ctx.mesh((ctx.world_size, 1), (_DP_DIM, _TP_DIM))
        hyper = optimizer.param_groups[0]
        saved = {k: hyper[k] for k in ("lr", "weight_decay") if k in hyper}
        # fully_shard re-adds one group at the optimizer's defaults and steps it once: at lr 0 and no decay
        # that step moves nothing (the module docstring says why).
        optimizer.defaults.update({k: 0.0 for k in saved})
        root, optimizer = megatron_fsdp.fully_shard(
            model, optimizer, device_mesh=mesh, dp_shard_dim=_DP_DIM, tp_dim=_TP_DIM, device=ctx.device,
            fsdp_unit_modules=units, **self.keywords)
        optimizer.defaults.update(saved)
        for group in optimizer.param_groups:
            group.update(saved)
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
        # After fully_shard the module holds the distributed parameters, in named_parameters' order, which
        # the optimizer steps and whose gradients the post-backward sync attaches.
        dist_named = [(canonical_name(n), p) for n, p in root.module.named_parameters()]
        owned = _MegatronStep(root, optimizer, dist_named, model)
        return EngineTrainee(
            root, model,
            read_grads=owned.grads,
            read_params=owned.params,
            read_facts=lambda: EngineFacts({ctx.device.type}, None),
            owned=OwnedStep(lambda loss: loss.backward(), owned.step, owned.save, owned.load),
        )


def _full(value: Any, like: Any) -> torch.Tensor:
    """The full tensor of ``value``, an uneven DTensor shaped and placed as the distributed parameter ``like``
    (None where this rank's piece is empty: an empty local piece stands in); collective."""
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
    from torch.distributed.tensor import DTensor

    if value is None:
        local = like.to_local() if isinstance(like, DTensor) else like
        value = DTensor.from_local(torch.zeros_like(local), device_mesh=like.device_mesh, placements=like.placements,
                                   shape=like.shape, stride=like.stride())
    if not isinstance(value, DTensor):
        return value.detach()
    return uneven_dtensor_to_full_tensor(value.detach())


def _piece(like: Any) -> tuple[slice, ...] | None:
    """Where this rank's piece of the uneven DTensor ``like`` lies in the full tensor (None: ``like`` is a
    plain tensor, held whole); collective."""
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return None
    chunk = gather_and_compute_chunk_metadata(like)
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


@torch.no_grad()
def _write_piece(target: Any, full: torch.Tensor, where: tuple[slice, ...] | None) -> None:
    """Copy this rank's piece (``where``) of ``full`` into ``target``'s local tensor."""
    local = target.to_local() if hasattr(target, "to_local") else target
    piece = full if where is None else full[where]
    local.copy_(piece.reshape(local.shape).to(local.device, local.dtype))


class _MegatronStep:
    """The training step, readers and full checkpoint of one MegatronFSDP module on one rank."""

    def __init__(self, root: Any, optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]],
                 model: nn.Module) -> None:
        self.root = root
        self.optimizer = optimizer
        self.named = named
        #: the module fully_shard was given: the names of tied parameters and the buffers of the full checkpoint.
        self.model = model

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named if p.requires_grad]

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def grads(self) -> list[ParamSlice]:
        return [ParamSlice.full(n, _full(p.grad, p)) for n, p in self._trainable()]

    def params(self) -> list[ParamSlice]:
        return [ParamSlice.full(n, _full(p, p)) for n, p in self.named]

    def _state_keys(self, ctx: RankContext) -> tuple[list[str], dict[str, Any]]:
        """The optimizer state's per-element keys and its scalars, agreed over the ranks (a rank whose every
        piece is empty holds no state); collective."""
        sample = next((s for s in self.optimizer.state.values() if s), {})
        mine = ([k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0],
                {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in sample.items()
                 if not (torch.is_tensor(v) and v.dim() > 0)})
        said: list[Any] = [None] * dist.get_world_size(ctx.world_group())
        dist.all_gather_object(said, mine, group=ctx.world_group())
        keys = sorted({k for tensors, _ in said for k in tensors})
        scalars = next((s for _, s in said if s), {})
        return keys, scalars

    def save(self, kind: str, path: Path, ctx: RankContext) -> None:
        keys, scalars = self._state_keys(ctx)
        model = neutral_model_state(self.model, {n: _full(p, p).cpu().clone() for n, p in self.named}, canonical_name)
        state = {}
        for name, p in self._trainable():
            held = self.optimizer.state.get(p, {})
            state[name] = {**{k: _full(held.get(k), p).cpu().clone() for k in keys},
                           **{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}}
        groups = neutral_param_groups(self.optimizer.param_groups, [n for n, _ in self._trainable()])
        if ctx.rank == 0:
            torch.save({"model": model, "optim": {"state": state, "param_groups": groups}}, path / NEUTRAL_FULL_FILE)
        dist.barrier(group=ctx.world_group())

    @torch.no_grad()
    def load(self, kind: str, path: Path, ctx: RankContext, fault: str) -> None:
        error: BaseException | None = None
        try:  # each rank reads rank 0's file: a failure here is this rank's alone
            saved = torch.load(path / NEUTRAL_FULL_FILE, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below, after agreeing
            error = exc
        agree_loaded(error, ctx)
        model, optim = saved["model"], saved["optim"]
        missing = sorted({n for n, _ in self.named} - set(model))
        if missing:
            raise KeyError(f"the full checkpoint lacks parameters {missing}: saved from another model?")
        # Every rank locates every piece first (collective), whatever it then writes.
        where = {n: _piece(p) for n, p in self.named}
        for name, p in self.named:
            _write_piece(p, model[name].reshape(p.shape), where[name])
        keys, _ = self._state_keys(ctx)
        for name, p in self._trainable():
            entry = optim["state"].get(name, {})
            absent = [k for k in keys if k not in entry]
            if absent:
                raise KeyError(f"the full checkpoint has no optimizer state {absent} for {name}: saved with another optimizer?")
            held = self.optimizer.state.get(p)
            if held is None:  # this rank's piece is empty: no state to write
                continue
            for key, value in entry.items():
                if key in keys:
                    _write_piece(held[key], value.reshape(p.shape), where[name])
                elif torch.is_tensor(held.get(key)):
                    held[key].fill_(value)
                else:
                    held[key] = value
        # The main weights are written: install them into the module's compute weights and gather those.
        self.root.install_optimized_model_weights()
        self.root.start_param_sync(force_sync=True)
        if fault == "drop_optimizer_state":
            self.optimizer.state.clear()
