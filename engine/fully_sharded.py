"""``FullyShardedDataParallel``: the FSDP1 public API over our units and runtime.

The class is thin: construction checks the arguments, resolves the process groups
(:mod:`engine.groups`), optionally auto-wraps children, materializes, moves and syncs the module
states (:mod:`engine.materialize`), chooses the compute device and makes the instance's one
:class:`~engine.config.UnitConfig`; it flattens the parameters no child took into one
:class:`~engine.flat_param.FlatParamHandle` under an :class:`~engine.unit.FsdpUnit`, and hands
config and unit to its :class:`~engine.state.ModuleState`, whose hooks ``forward`` calls. Utilities
(``no_sync``, ``summon_full_params``, ``clip_grad_norm_``) live here because they are FSDP1
methods; their logic is in :mod:`engine.summon` and :mod:`engine.grad_norm`. Arguments are
checked in :mod:`engine.arguments`. Dependencies point down: nothing in the engine imports this
module but the package's ``__init__``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch import Tensor

from engine.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from engine.arguments import normalize_arguments
from engine.checkpoint_methods import CheckpointMethods
from engine.config import UnitConfig, choose_compute_device, current_accelerator_device, materialization_device
from engine.context import RootContext
from engine.dynamo import eager_frame
from engine.flat_param import FlatParamHandle
from engine.grad_norm import clip_grad_norm
from engine.groups import ProcessGroupArg, resolve_groups
from engine.lifecycle import TrainingLifecycle, TrainingState
from engine.materialize import FLATTENED, managed_params, materialize, move_cpu_states, sync_states
from engine.module_tree import is_fsdp, managed_buffers
from engine.precision import full_prec_in_eval_from_env
from engine.state_dict import post_state_dict_hook
from engine.state import ModuleState
from engine.summon import summon_full_params
from engine.unit import FsdpUnit
from engine.wrap import auto_wrap

__all__ = ["FullyShardedDataParallel", "FSDP"]

#: name of the flat parameter on the wrapped module (``use_orig_params=False``), as in FSDP1.
FLAT_PARAM = "_flat_param"
#: prefix FSDP adds to every name under it, as in FSDP1.
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."


@contextlib.contextmanager
def _set_on_units(units: list[Any], attr: str, value: Any) -> Iterator[None]:
    """Set ``attr`` on every unit for the duration; each unit gets its own earlier value back."""
    previous = [getattr(u, attr) for u in units]
    for u in units:
        setattr(u, attr, value)
    try:
        yield
    finally:
        for u, prev in zip(units, previous):
            setattr(u, attr, prev)


class FullyShardedDataParallel(CheckpointMethods, nn.Module):
    """Shards a module's parameters across data-parallel ranks (torch FSDP1's API).

    See torch's ``FullyShardedDataParallel`` for the meaning of each argument; the differences:
    ``ignored_states`` accepts modules or parameters. State dicts, optimizer state and
    communication hooks (the :class:`~engine.checkpoint_methods.CheckpointMethods` methods) follow
    FSDP1; see :mod:`engine.state_dict` for the few deliberate differences.
    """

    #: marks instances for ``engine.wrap`` (already-wrapped detection) and ``engine.module_tree``.
    _is_fsdp_unit = True

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroupArg = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
        args = normalize_arguments(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
        )
        super().__init__()
        strategy = args.sharding_strategy
        shard_group, replicate_group = resolve_groups(strategy, process_group, device_mesh)
        if strategy not in HYBRID_STRATEGIES and shard_group.size() == 1 and strategy != ShardingStrategy.NO_SHARD:
            # One rank holds everything: sharding is NO_SHARD (FSDP1 switches the same way).
            strategy = ShardingStrategy.NO_SHARD

        ignored_mods, ignored_params = self._ignored(module, ignored_modules, ignored_states)
        if auto_wrap_policy is not None:
            # Every child gets the root's arguments (checked, in the engine's types), which a
            # policy may override per child.
            root_kwargs = {
                **args._asdict(),
                "sharding_strategy": strategy,
                "process_group": (shard_group, replicate_group) if strategy in HYBRID_STRATEGIES else shard_group,
                "param_init_fn": param_init_fn,
                "ignored_states": list(ignored_mods) + list(ignored_params),
            }
            auto_wrap(module, auto_wrap_policy, FullyShardedDataParallel, ignored_mods, ignored_params, root_kwargs)

        # Devices as torch FSDP1 decides them: from device_id, the parameters and the current
        # accelerator device, never from the communication backend.
        current = current_accelerator_device()
        materialize(module, param_init_fn, materialization_device(args.device_id, current), ignored_mods)
        if args.device_id is not None:
            move_cpu_states(module, args.device_id, ignored_mods)
        params = managed_params(module, ignored_mods, {id(p) for p in ignored_params})
        compute_device = choose_compute_device(args.device_id, [p.device for p in params], current)
        if args.sync_module_states:
            groups = [shard_group] + ([replicate_group] if replicate_group is not None else [])
            sync_states(params + managed_buffers(module, ignored_mods), groups)

        config = UnitConfig(
            strategy=strategy,
            compute_device=compute_device,
            shard_group=shard_group,
            replicate_group=replicate_group,
            offload_params=args.cpu_offload.offload_params,
            mixed_precision=args.mixed_precision,
            use_orig_params=args.use_orig_params,
            backward_prefetch=args.backward_prefetch,
            forward_prefetch=args.forward_prefetch,
            limit_all_gathers=args.limit_all_gathers,
            use_full_prec_in_eval=full_prec_in_eval_from_env(),
        )
        self._fsdp_wrapped_module = module
        lifecycle = TrainingLifecycle(type(module).__name__)
        unit: FsdpUnit | None = None
        if params:
            handle = FlatParamHandle.from_config(params, module, config)
            handle.shard()
            for p in params:
                setattr(p, FLATTENED, True)
            if not config.use_orig_params:
                module.register_parameter(FLAT_PARAM, handle.flat_param)
            unit = FsdpUnit(handle, module_name=type(module).__name__, lifecycle=lifecycle)
        #: everything below the public API: the configuration, the unit, the hooks.
        self._fsdp_state = ModuleState(
            wrapper=self, module=module, config=config, unit=unit, lifecycle=lifecycle, ignored_modules=ignored_mods
        )
        self._register_state_dict_hook(_buffers_in_original_dtype)
        # Registered after the dtype hook, which reads the unconverted (wrapped) names.
        self._register_state_dict_hook(post_state_dict_hook)

    @staticmethod
    def _ignored(
        module: nn.Module, ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[Any] | None
    ) -> tuple[set[nn.Module], set[nn.Parameter]]:
        if ignored_modules is not None and ignored_states is not None:
            raise ValueError("Cannot pass both ignored_modules and ignored_states: pass only ignored_states")
        mods: set[nn.Module] = set()
        params: set[nn.Parameter] = set()
        for item in list(ignored_modules or []) + list(ignored_states or []):
            if isinstance(item, nn.Parameter):
                params.add(item)
            elif isinstance(item, nn.Module):
                if is_fsdp(item):
                    raise ValueError(
                        f"ignored_modules must not contain FSDP units but got a {type(item).__name__}: "
                        "ignore the wrapped module instead"
                    )
                if item is module:
                    raise ValueError("Cannot ignore the module being wrapped itself: ignore its submodules instead")
                mods.update(item.modules())
            else:
                raise TypeError(f"ignored states must be nn.Module or nn.Parameter, got {type(item).__name__}")
        for m in mods:
            params.update(m.parameters())
        return mods, params

    # ------------------------------------------------------------------ module protocol
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    @eager_frame
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state
        if state.lifecycle.state == TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(
                f"FSDP unit wrapping {type(self.module).__name__}: forward inside summon_full_params "
                "is not supported; run forward outside the context (or copy the summoned parameters "
                "into an unwrapped module)"
            )
        if state.is_root is None:
            state.lazy_init()
        if state.is_root:
            args, kwargs = state.root_pre_forward(args, kwargs)
        args, kwargs = state.pre_forward(args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return state.post_forward(output)

    # The module state's fields under the names FSDP1's instances (and tools written against
    # them) use; the state is their only owner.
    @property
    def _unit(self) -> FsdpUnit | None:
        return self._fsdp_state.unit

    @property
    def _handle(self) -> FlatParamHandle | None:
        """This unit's ``FlatParamHandle`` (None when it flattened nothing), under FSDP1's attribute name:
        tools written for torch FSDP1 find the flat parameter through ``module._handle.flat_param``."""
        unit = self._fsdp_state.unit
        return unit.handle if unit is not None else None

    @property
    def _is_root(self) -> bool | None:
        return self._fsdp_state.is_root

    @property
    def _ctx(self) -> RootContext | None:
        return self._fsdp_state.ctx

    @property
    def _sync_gradients(self) -> bool:
        return self._fsdp_state.sync_gradients

    @_sync_gradients.setter
    def _sync_gradients(self, value: bool) -> None:
        self._fsdp_state.sync_gradients = value

    @property
    def _training_state(self) -> TrainingState:
        return self._fsdp_state.lifecycle.state

    @property
    def _compute_device(self) -> torch.device:
        return self._fsdp_state.config.compute_device

    @property
    def _mixed_precision(self) -> MixedPrecision | None:
        return self._fsdp_state.config.mixed_precision

    @property
    def _ignored_modules(self) -> set[nn.Module]:
        return self._fsdp_state.ignored_modules

    # FSDP1's public state attributes, read by tools and tests written against it; the
    # configuration is their only owner.
    @property
    def process_group(self) -> Any:
        return self._fsdp_state.config.shard_group

    @property
    def _replicate_group(self) -> Any:
        return self._fsdp_state.config.replicate_group

    @property
    def rank(self) -> int:
        return self._fsdp_state.rank

    @property
    def world_size(self) -> int:
        return self._fsdp_state.world_size

    @property
    def compute_device(self) -> torch.device:
        return self._fsdp_state.config.compute_device

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._fsdp_state.config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._fsdp_state.config.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._fsdp_state.config.limit_all_gathers

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._fsdp_state.config.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._fsdp_state.config.offload_params)

    _cpu_offload = cpu_offload

    @property
    def _sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp_state.config.strategy

    @property
    def _use_orig_params(self) -> bool:
        return self._fsdp_state.config.use_orig_params

    @property
    def _state_dict_type(self) -> StateDictType:
        return self._fsdp_state.state_dict_settings.state_dict_type

    @property
    def _state_dict_config(self) -> StateDictConfig:
        return self._fsdp_state.state_dict_settings.state_dict_config

    @property
    def _optim_state_dict_config(self) -> OptimStateDictConfig:
        return self._fsdp_state.state_dict_settings.optim_state_dict_config

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Inside ``summon_full_params`` names carry no ``_fsdp_wrapped_module.`` prefix (FSDP1)."""
        clean = self._training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        clean = self._training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), buf

    # ------------------------------------------------------------------ introspection
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every unit in ``module``'s tree (``root_only``: those with no unit above them)."""
        if not root_only:
            return [m for m in module.modules() if is_fsdp(m)]
        roots: list[FullyShardedDataParallel] = []
        inside: set[int] = set()
        for m in module.modules():
            if is_fsdp(m) and id(m) not in inside:
                roots.append(m)  # type: ignore[arg-type]
                inside.update(id(sub) for sub in m.modules())
        return roots

    @property
    def _flat_param(self) -> nn.Parameter | None:
        """This unit's flat parameter (None for a unit with no parameters of its own), as FSDP1."""
        return self._unit.handle.flat_param if self._unit is not None else None

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp_state.config.strategy

    @property
    def training_state(self) -> TrainingState:
        return self._fsdp_state.lifecycle.state

    def _assert_state(self, state: Any) -> None:
        """``ValueError`` unless this unit is in ``state`` (or one of a list of them), as torch FSDP1's: torch's
        own test machinery (``common_fsdp``) calls it with torch's ``TrainingState``, matched by name."""
        wanted = state if isinstance(state, (list, tuple)) else [state]
        names = {getattr(s, "name", str(s)) for s in wanted}
        ours = self.training_state
        # torch FSDP1 has one state for all of forward and backward; ours tells them apart.
        aliases = {ours.name} | ({"FORWARD_BACKWARD"} if ours not in (TrainingState.IDLE, TrainingState.SUMMON_FULL_PARAMS) else set())
        if not aliases & names:
            raise ValueError(f"expected to be in states {sorted(names)} but the current state is {ours.name} "
                             f"(unit {self._fsdp_state.lifecycle.owner})")

    def _ensure_root(self, what: str) -> RootContext:
        state = self._fsdp_state
        if state.is_root is None:
            state.lazy_init()
        if not state.is_root:
            raise RuntimeError(
                f"{what} should only be called on the root FSDP instance, but it was called on a "
                f"nested unit wrapping {type(self.module).__name__}: call it on the outermost "
                "FullyShardedDataParallel"
            )
        busy = [s for s in state.tree if not s.lifecycle.idle]
        if busy:
            raise RuntimeError(
                f"{what} cannot run during forward or backward (unit {busy[0].lifecycle.owner} is "
                f"{busy[0].lifecycle.state.name}): call it between iterations"
            )
        return state.ctx

    # ------------------------------------------------------------------ utilities
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within the context, backward accumulates unsharded gradients without communicating;
        the first backward after it reduces everything accumulated."""
        self._ensure_root("no_sync()")
        with _set_on_units(self.fsdp_modules(self), "_sync_gradients", False):
            yield

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Within the context, the original parameters are full ``nn.Parameter``s (full precision)."""
        with summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of every parameter under this root to a total norm of ``max_norm``
        (norm over all shards); returns the total norm before clipping."""
        ctx = self._ensure_root("clip_grad_norm_()")
        return clip_grad_norm(self, self.process_group, ctx, max_norm, norm_type)

    def check_is_root(self) -> bool:
        """Whether this instance is the root of its tree (decided at lazy initialization)."""
        if self._is_root is None:
            self._fsdp_state.lazy_init()
        return bool(self._is_root)

    def extra_repr(self) -> str:
        return f"sharding_strategy={self._sharding_strategy.name}, use_orig_params={self._use_orig_params}"


def _buffers_in_original_dtype(
    module: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict hook: buffers are saved in the dtype they were created with (FSDP1), whatever
    ``buffer_dtype`` they compute in; the module's own buffers are not touched."""
    ctx = module._ctx
    if ctx is None or ctx.buffers is None:
        return
    for name, buf in module.named_buffers():
        key = prefix + name
        original = ctx.buffers.original_dtype(buf)
        if original is not None and key in state_dict and state_dict[key].dtype != original:
            state_dict[key] = state_dict[key].to(original)


FSDP = FullyShardedDataParallel
