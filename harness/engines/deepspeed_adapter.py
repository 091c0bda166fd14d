"""DeepSpeed ZeRO through ``deepspeed.initialize`` and DeepSpeed's public API: an engine that owns its
training step (``harness.engines.owned_step``).

Registered as ``deepspeed-zero1``, ``deepspeed-zero2`` and ``deepspeed-zero3`` (``harness.engines.registry``),
and as the API kind ``NAME=deepspeed:PATH.json``: a DeepSpeed config file whose keys override the
adapter's defaults (dictionaries merge key by key, so ``{"zero_optimization": {"stage": 2}}`` changes the
stage alone). The stage decides the one strategy the engine maps, by what it shards: stage 1
(optimizer state) ``zero1``, stage 2 (plus gradients) ``zero2``, stage 3 (plus parameters) ``full_shard``.

The defaults are neutral, so DeepSpeed trains like DDP unless the config says otherwise:
``gradient_clipping`` 0 (DeepSpeed clips to ``GRADIENT_CLIPPING_DEFAULT`` = 1.0 when the key is
absent), one micro-batch per step, the harness's own torch optimizer (SGD or AdamW, which ZeRO wraps:
``zero_allow_untested_optimizer``). A config that clips anyway shows as a finding in the failing case's
reason (``harness.engines.owned_step.FINDING``).

The harness reads gradients between ``engine.backward`` and ``engine.step`` with
``deepspeed.utils.safe_get_full_grad`` and the final parameters inside ``deepspeed.zero.GatheredParameters``,
by original parameter name, whatever the stage partitions. Checkpoints: ``sharded`` is DeepSpeed's own
``engine.save_checkpoint``/``load_checkpoint`` (only the same engine loads it); ``full`` is the neutral full
state dict (``harness.engines.owned_step``), which FSDP engines save and load too (cross-engine resume).

Without ``deepspeed`` installed (``pip install -e .[deepspeed]``) every case of these engines is
``unsupported`` with that one line.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.capabilities import Rule, prefixed_rule
from harness.cases.case import CaseConfig
from harness.cases.dtypes import dtype_of
from harness.cases.models import ZooModel, to_device
from harness.engines.activation_checkpointing import apply_activation_checkpointing, checkpointed_units
from harness.engines.adapters import EngineAdapter, EngineFacts, EngineTrainee, ParamSlice, canonical_name, module_version
from harness.engines.checkpoint import agree_loaded
from harness.engines.optim import build_optimizers
from harness.engines.owned_step import FINDING, NEUTRAL_FULL_FILE, OwnedStep, neutral_model_state, neutral_param_groups
from harness.engines.spec_files import read_json_object
from harness.ranks.rank import RankContext

__all__ = ["DEEPSPEED_STAGES", "DeepSpeedAdapter", "deepspeed_missing", "destroy_finished_engine", "merged_config",
           "neutral_config"]

#: ZeRO stage -> the strategy (``harness.cases.case.ShardingName``) that shards what it shards.
DEEPSPEED_STAGES: dict[int, str] = {1: "zero1", 2: "zero2", 3: "full_shard"}
#: DeepSpeed's own default for ``gradient_clipping`` (``deepspeed.runtime.constants``), for the finding's text.
DEEPSPEED_CLIPPING_DEFAULT = 1.0
_OWN_DIR = "deepspeed"
_OWN_TAG = "harness"


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot be used here (one line), or None when it is installed."""
    if importlib.util.find_spec("deepspeed") is None:
        return ("deepspeed is not installed: pip install -e .[deepspeed] "
                "(DS_BUILD_OPS=0, --no-build-isolation, with your torch pinned beside it)")
    return None


def neutral_config(stage: int) -> dict[str, Any]:
    """The adapter's DeepSpeed config for ``stage``: what trains like DDP."""
    return {
        # The harness feeds one batch per rank and step; DeepSpeed's data loader is never used.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # DeepSpeed clips to 1.0 when the key is absent (GRADIENT_CLIPPING_DEFAULT): DDP does not clip.
        "gradient_clipping": 0.0,
        # The harness's own torch optimizer (SGD with momentum, AdamW), which ZeRO wraps.
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


#: DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements), which ZeRO allocates in full with
#: contiguous gradients (its default): stage 3 at ``deepspeed.initialize``, stages 1 and 2 at their first
#: reduce. 2 GB of fp32 a rank, for the harness's models of kilobytes: 16 pytest-xdist workers' ranks
#: filled 141 GiB H200s with it.
DEFAULT_REDUCE_BUCKET = 500_000_000


def bucket_sized_to_model(config: dict[str, Any], user: dict[str, Any], numel: int) -> dict[str, Any]:
    """``config`` with its reduce bucket no larger than the model's ``numel`` elements, unless the user's
    config sets one. A bucket that holds every gradient groups them as DeepSpeed's default does for any
    model under ``DEFAULT_REDUCE_BUCKET`` elements (one bucket), so the reductions are the same."""
    sized = {} if "reduce_bucket_size" in user.get("zero_optimization", {}) else {
        "zero_optimization": {"reduce_bucket_size": max(1, min(DEFAULT_REDUCE_BUCKET, numel))}}
    # A copy either way (``merged_config``'s): DeepSpeed may write into the config it is given.
    return merged_config(config, sized)


def merged_config(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override``'s keys over ``base``'s; dictionaries merge key by key (a config naming one
    ``zero_optimization`` key keeps the others)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged_config(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_rule = functools.partial(prefixed_rule, "deepspeed")

#: the engine this rank process built last. DeepSpeed expects one engine per process, but a rank of a pool
#: runs case after case: ZeRO-3 keeps every engine's top module in a module-level list
#: (``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``), so no engine is ever freed, and each kept
#: its reduce bucket (2 GB a rank by default) until the GPUs were full. A rank runs one case at a time, and a
#: resumed case drops its saving engine before it builds the loading one, so the engine built before is
#: finished when the next is built: ``engine.destroy()`` (DeepSpeed's own teardown) releases its buffers.
_last_engine: "weakref.ref[Any] | None" = None


def destroy_finished_engine() -> bool:
    """``destroy()`` the engine this process built last, if it is still alive; True when one was."""
    global _last_engine
    engine = _last_engine() if _last_engine is not None else None
    _last_engine = None
    if engine is None:
        return False
    engine.destroy()
    return True


#: What the DeepSpeed adapters do not express, whatever the stage, each with DeepSpeed's reason.
DEEPSPEED_RULES: tuple[Rule, ...] = (
    _rule("precision", ("precision",),
          "mixed precision is DeepSpeed's bf16/fp16 config sections (module cast, fp32 master weights in its "
          "optimizer, its own loss scaling), which this adapter does not map yet: fp32 only",
          lambda c: c["precision"] != "fp32"),
    _rule("prefetch", ("backward_prefetch", "forward_prefetch"),
          "DeepSpeed has no FSDP-style forward/backward prefetch setting (ZeRO-3 prefetches by "
          "stage3_prefetch_bucket_size)",
          lambda c: c["backward_prefetch"] != "none" or c["forward_prefetch"]),
    _rule("offload", ("cpu_offload",),
          "ZeRO offload (offload_param, stage 3 only; offload_optimizer with DeepSpeed's CPU Adam op) is not "
          "mapped by this adapter",
          lambda c: c["cpu_offload"]),
    _rule("orig_params", ("use_orig_params",),
          "DeepSpeed keeps the module's original parameters (no flat-parameter view): only use_orig_params=True "
          "describes it",
          lambda c: not c["use_orig_params"]),
    _rule("init_after", ("init_mode",),
          "deepspeed.initialize places the module on its device itself; moving the engine afterwards is not "
          "its API",
          lambda c: c["init_mode"] == "after"),
    _rule("one_optimizer", ("optimizer",),
          "deepspeed.initialize takes one optimizer",
          lambda c: c["optimizer"] == "two_optimizers"),
    _rule("clip", ("clip_grad",),
          "DeepSpeed clips inside engine.step() (gradient_clipping in its config): the clipped gradients are "
          "never observable between backward and step, where the harness compares them",
          lambda c: c["clip_grad"] != "none"),
    _rule("accumulation", ("grad_accum",),
          "DeepSpeed accumulates to its own gradient_accumulation_steps boundary (ZeRO-2 and -3 reduce every "
          "micro-batch into their partitions, and no_sync() refuses them): not the no_sync/sync axis",
          lambda c: c["grad_accum"] != "none"),
    _rule("compile", ("compile",),
          "a DeepSpeed engine compiles through engine.compile(), not torch.compile of its module: not mapped",
          lambda c: c["compile"] != "none"),
    _rule("reshard", ("checkpoint",),
          "DeepSpeed saves sharded checkpoints in its own format, not DCP: no DCP reshard",
          lambda c: c["checkpoint"] == "dcp-reshard"),
)


class DeepSpeedAdapter(EngineAdapter):
    """DeepSpeed ZeRO at one stage (``stage``) or as a user's config file (``config_path``)."""

    owns_step = True

    def __init__(self, name: str, *, stage: int | None = None, config_path: str | None = None) -> None:
        self.name = name
        self.config_path = config_path
        self._stage = stage
        if config_path is not None:
            # Read now: a bad file stops the run before anything runs (``harness.engines.registry.resolve``).
            self._user = read_json_object(config_path, "deepspeed")
        else:
            self._user = {}

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The DeepSpeed config every case of this engine starts from: the neutral one, the file's keys over it."""
        return merged_config(neutral_config(self._stage or 3), self._user)

    @property
    def stage(self) -> int:
        stage = self.config.get("zero_optimization", {}).get("stage", 0)
        if stage not in DEEPSPEED_STAGES:
            where = f"config {self.config_path!r}" if self.config_path else f"engine {self.name!r}"
            raise ValueError(f"{where}: zero_optimization.stage={stage!r}; the adapter maps stages "
                             f"{sorted(DEEPSPEED_STAGES)} (set zero_optimization.stage to one of them)")
        return int(stage)

    @property
    def sums_in_own_order(self) -> bool:  # type: ignore[override]
        # ZeRO-3 reduce-scatters flat partitions (gradients 1e-6 off the reference's on CPU too), and its
        # memory_efficient_linear (on by default) replaces F.linear by LinearFunctionForZeroStage3, whose
        # backward sums the bias gradient and multiplies for the weight's its own way: on two NCCL GPUs the
        # transformer's losses left the reference's by 4e-6 at step 1 (0 with the nested model, 2-D inputs).
        return self.stage == 3

    @property
    def strategies(self) -> tuple[str, ...]:  # type: ignore[override]
        return (DEEPSPEED_STAGES[self.stage],)

    def capability_rules(self) -> tuple[Rule, ...]:
        return DEEPSPEED_RULES

    def checkpoint_kinds(self) -> tuple[str, ...]:
        return ("full", "sharded")

    def check(self) -> None:
        self.stage  # noqa: B018 - a config with an unmapped stage stops the run here

    def version(self) -> str:
        return module_version("deepspeed") if deepspeed_missing() is None else "not installed"

    def unsupported_reason(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> str | None:
        reason = deepspeed_missing() or self.unsupported(case)
        if reason is None and model.rank_local_modules():
            reason = "DeepSpeed reduces every parameter over the data-parallel group: no rank-local modules"
        if reason is None and self.stage == 3 and ctx.device.type == "cuda" and ctx.device.index != ctx.local_rank:
            # zero.Init sets the device from the variable (deepspeed/runtime/zero/partition_parameters.py).
            reason = (f"ZeRO-3 allocates on cuda:$LOCAL_RANK (cuda:{ctx.local_rank}), not the rank's {ctx.device}: "
                      "ranks sharing a GPU cannot run it; give each rank a GPU of its own")
        return f"{self.name}: {reason}" if reason else None

    def build(self, case: CaseConfig, model: ZooModel, ctx: RankContext) -> EngineTrainee:
        import deepspeed

        global _last_engine
        destroy_finished_engine()
        if case.init_mode == "before":
            model.to(ctx.device)
        apply_activation_checkpointing(model, checkpointed_units(model), case.activation_checkpointing)
        named = [(canonical_name(n), p) for n, p in model.named_parameters()]
        (optimizer,) = build_optimizers(case, named)
        _trace_deepspeed_collectives()
        # ``device_rank``: the rank's own device (a pool's GPU need not be its LOCAL_RANK's).
        args = SimpleNamespace(local_rank=ctx.local_rank,
                               device_rank=ctx.device.index if ctx.device.type == "cuda" else ctx.local_rank)
        # Under zero.Init a parameter is already partitioned: ``ds_numel`` is its full size.
        numel = sum(getattr(p, "ds_numel", p.numel()) for _, p in named)
        engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                               config=bucket_sized_to_model(self.config, self._user, numel),
                                               dist_init_required=False)
        _last_engine = weakref.ref(engine)
        _trace_deepspeed_collectives()
        notes: list[str] = []

        def prime() -> None:
            """One step over a zero loss: the optimizer state a fresh engine lacks until its first step."""
            inputs = to_device(model.get_input(seed=case.seed, step=0, rank=ctx.rank), ctx.device,
                               dtype_of(case.precision_spec.full))
            engine.backward(model.get_loss(inputs, engine(*inputs)) * 0.0)
            engine.step()

        clipping = float(self.config.get("gradient_clipping", 0.0) or 0.0)
        owned = _DeepSpeedStep(self.name, engine, named, clipping, notes, prime)
        return EngineTrainee(
            engine, model,
            read_grads=owned.grads,
            read_params=owned.params,
            read_facts=lambda: EngineFacts({p.device.type for p in engine.module.parameters()}, None),
            notes=notes,
            owned=OwnedStep(owned.backward, owned.step, owned.save, owned.load),
        )


def _trace_deepspeed_collectives() -> None:
    """DeepSpeed's torch backend binds ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` once, when
    it is created: bind them again now, so the communication trace of this case (which wraps
    ``torch.distributed``'s functions while it runs) sees DeepSpeed's gathers and scatters, not a stale
    wrapper of an earlier case."""
    from deepspeed import comm

    backend = getattr(comm.comm, "cdb", None)
    if backend is not None and hasattr(backend, "get_all_gather_function"):
        backend.all_gather_function = backend.get_all_gather_function()
        backend.reduce_scatter_function = backend.get_reduce_scatter_function()


class _DeepSpeedStep:
    """The training step, readers and checkpoint hooks of one DeepSpeed engine on one rank."""

    def __init__(self, name: str, engine: Any, named: list[tuple[str, nn.Parameter]], clipping: float,
                 notes: list[str], prime: Callable[[], None]) -> None:
        self.prime = prime
        self.name = name
        self.engine = engine
        self.named = named
        self.clipping = clipping
        self.notes = notes
        self.steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()
        self.steps += 1
        norm = self.engine.get_global_grad_norm() if self.clipping > 0 else None
        if norm is not None and float(norm) > self.clipping and not any(n.startswith(FINDING) for n in self.notes):
            self.notes.append(
                f"{FINDING}{self.name} clipped the gradients to gradient_clipping={self.clipping:g} (total norm "
                f"{float(norm):.3g} at step {self.steps - 1}) and the case does not clip: DeepSpeed clips to "
                f"{DEEPSPEED_CLIPPING_DEFAULT:g} unless its config sets gradient_clipping (0 trains like DDP)")

    def grads(self) -> list[ParamSlice]:
        from deepspeed.utils import safe_get_full_grad

        out = []
        for name, p in self.named:
            grad = safe_get_full_grad(p) if p.requires_grad else None  # collective under ZeRO-2/3: every rank asks
            if grad is not None:
                out.append(ParamSlice.full(name, grad))
        return out

    def params(self) -> list[ParamSlice]:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in self.named]):  # ZeRO-1/2: nothing to gather
            return [ParamSlice.full(name, p) for name, p in self.named]

    # -- checkpoints -------------------------------------------------------------------------------

    def _inner(self) -> torch.optim.Optimizer:
        """The torch optimizer ZeRO wraps (its state is kept per flat partition)."""
        return self.engine.optimizer.optimizer

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named if p.requires_grad]

    def _state_keys(self) -> tuple[list[str], dict[str, Any]]:
        """The optimizer state's per-element keys (momentum, moments) and its scalars (Adam's step)."""
        sample = next(iter(self._inner().state.values()), {})
        tensors = [k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0]
        return tensors, {k: v for k, v in sample.items() if k not in tensors}

    def neutral_state(self) -> dict[str, Any]:
        """The neutral full state dict (``harness.engines.owned_step``); collective."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        keys, scalars = self._state_keys()
        model = {n: p.detach().cpu().clone() for n, p in ((n, safe_get_full_fp32_param(p)) for n, p in self._trainable())}
        frozen = [(n, p) for n, p in self.named if not p.requires_grad]
        if frozen:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
                model.update({n: p.detach().cpu().clone() for n, p in frozen})
        state = {n: {**{k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in keys},
                     **{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}}
                 for n, p in self._trainable()}
        groups = neutral_param_groups(self._inner().param_groups, [n for n, _ in self._trainable()])
        model = neutral_model_state(self.engine.module, model, canonical_name)
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    def save(self, kind: str, path: Path, ctx: RankContext) -> None:
        if kind == "sharded":
            self.engine.save_checkpoint(str(path / _OWN_DIR), tag=_OWN_TAG)
        else:
            state = self.neutral_state()
            if ctx.rank == 0:
                torch.save(state, path / NEUTRAL_FULL_FILE)
        dist.barrier(group=ctx.world_group())

    def load(self, kind: str, path: Path, ctx: RankContext, fault: str) -> None:
        if kind == "sharded":
            self.engine.load_checkpoint(str(path / _OWN_DIR), tag=_OWN_TAG)
        else:
            error: BaseException | None = None
            try:  # each rank reads rank 0's file: a failure here is this rank's alone
                state = torch.load(path / NEUTRAL_FULL_FILE, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - every rank raises it below, after agreeing
                error = exc
            agree_loaded(error, ctx)
            # safe_set_full_optimizer_state writes into state that exists: a fresh ZeRO engine has none (nor
            # its views per parameter) until its first step. Whatever that step changes is overwritten.
            self.prime()
            self._apply_neutral(state)
        if fault == "drop_optimizer_state":
            self._inner().state.clear()

    @torch.no_grad()
    def _apply_neutral(self, state: dict[str, Any]) -> None:
        """Put a neutral full state dict into this engine: the module's parameters, ZeRO's fp32 master
        copies and the optimizer state, through DeepSpeed's ``safe_set_*`` API; collective."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        model, optim = state["model"], state["optim"]
        missing = sorted({n for n, _ in self.named} - set(model))
        if missing:
            raise KeyError(f"the full checkpoint lacks parameters {missing}: saved from another model?")
        first = next(iter(optim["state"].values()), {})
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]
        scalars = [k for k in first if k not in keys]
        with deepspeed.zero.GatheredParameters([p for _, p in self.named], modifier_rank=0):
            for name, p in self.named:
                p.data.copy_(model[name].reshape(p.shape).to(p.device, p.dtype))
        for name, p in self._trainable():
            safe_set_full_fp32_param(p, model[name].to(p.device, torch.float32))
            saved = optim["state"].get(name, {})
            for key in keys:
                if key not in saved:
                    raise KeyError(f"the full checkpoint has no optimizer state {key!r} for {name}: saved with another optimizer?")
                safe_set_full_optimizer_state(p, saved[key].to(p.device, torch.float32), key)
        for entry in self._inner().state.values():
            for key in scalars:
                value = first[key]
                held = entry.get(key)
                entry[key] = value.clone().to(held.device) if torch.is_tensor(value) and torch.is_tensor(held) else value
