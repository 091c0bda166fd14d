"""``FullyShardedDataParallel``: the FSDP1 public API over our units and runtime.

The class is thin: construction resolves groups and devices, optionally auto-wraps children,
materializes and syncs the module states, and flattens the parameters no child took into one
:class:`~engine.flat_param.FlatParamHandle`; forward delegates to :mod:`engine.runtime`.
Utilities (``no_sync``, ``summon_full_params``, ``clip_grad_norm_``) live here because they are
FSDP1 methods; their logic is in :mod:`engine.summon` and :mod:`engine.grad_norm`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from engine import runtime
from engine.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    to_handle_strategy,
)
from engine.checkpoint_methods import CheckpointMethods
from engine.context import RootContext
from engine.flat_param import FlatParamHandle
from engine.precision import full_prec_in_eval_from_env, managed_buffers
from engine.state_dict import post_state_dict_hook
from engine.unit import FsdpUnit, TrainingState

__all__ = ["FullyShardedDataParallel", "FSDP"]

#: name of the flat parameter on the wrapped module (``use_orig_params=False``), as in FSDP1.
FLAT_PARAM = "_flat_param"
#: prefix FSDP adds to every name under it, as in FSDP1.
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
#: marks an original parameter some unit has flattened, so an enclosing unit skips it.
_FLATTENED = "_fsdp_flattened"

ProcessGroupArg = dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None


def _is_fsdp(module: nn.Module) -> bool:
    return getattr(type(module), "_is_fsdp_unit", False)


def _resolve_groups(
    strategy: ShardingStrategy, process_group: ProcessGroupArg, device_mesh: Any
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """``(shard group, replicate group or None)`` from FSDP1's ``process_group``/``device_mesh``."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh to FullyShardedDataParallel: pass "
            "only one (a device_mesh for a 2-D hybrid layout, or the groups directly)"
        )
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        if hybrid:
            if device_mesh.ndim != 2:
                raise ValueError(
                    f"{strategy} needs a 2-D device_mesh (replicate, shard) but got {device_mesh.ndim} dimensions"
                )
            return device_mesh.get_group(mesh_dim=1), device_mesh.get_group(mesh_dim=0)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{strategy} needs a 1-D device_mesh but got {device_mesh.ndim} dimensions: use a "
                "hybrid strategy for a 2-D mesh"
            )
        return device_mesh.get_group(mesh_dim=0), None
    if hybrid:
        if isinstance(process_group, tuple):
            if len(process_group) != 2:
                raise ValueError(
                    f"{strategy} takes process_group=(shard_group, replicate_group); got {len(process_group)} groups"
                )
            return process_group[0], process_group[1]
        if process_group is not None:
            raise ValueError(
                f"{strategy} needs process_group=(shard_group, replicate_group) or a 2-D device_mesh; "
                "got a single process group"
            )
        return _default_hybrid_groups()
    if isinstance(process_group, tuple):
        raise ValueError(
            f"process_group=(shard_group, replicate_group) is only valid with a hybrid strategy, not {strategy}"
        )
    return (process_group if process_group is not None else dist.distributed_c10d._get_default_group()), None


def _default_hybrid_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """FSDP1's default: shard within a node, replicate across nodes (every rank builds every group)."""
    world = dist.get_world_size()
    per_node = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if per_node <= 0 or world % per_node:
        raise ValueError(
            "HYBRID_SHARD without process_group needs CUDA devices that divide the world size to "
            f"infer the node size (world_size={world}, devices per node={per_node}); pass "
            "process_group=(shard_group, replicate_group) or a 2-D device_mesh"
        )
    rank = dist.get_rank()
    shard = replicate = None
    for start in range(0, world, per_node):
        group = dist.new_group(list(range(start, start + per_node)))
        if start <= rank < start + per_node:
            shard = group
    for offset in range(per_node):
        group = dist.new_group(list(range(offset, world, per_node)))
        if rank % per_node == offset:
            replicate = group
    return shard, replicate


def _managed_modules(module: nn.Module, ignored: set[nn.Module]) -> Iterator[nn.Module]:
    """``module`` and its descendants, not entering nested units or ignored modules."""
    stack = [module]
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        for child in reversed(list(m.children())):
            if not _is_fsdp(child) and child not in ignored:
                stack.append(child)


def _managed_params(module: nn.Module, ignored_modules: set[nn.Module], ignored_params: set[int]) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for m in _managed_modules(module, ignored_modules):
        for p in m._parameters.values():
            if p is None or id(p) in seen or id(p) in ignored_params or getattr(p, _FLATTENED, False):
                continue
            seen.add(id(p))
            params.append(p)
    return params


def _managed_buffers(module: nn.Module, ignored_modules: set[nn.Module]) -> list[Tensor]:
    return [b for m in _managed_modules(module, ignored_modules) for b in m._buffers.values() if b is not None]


def _device_from_id(device_id: int | torch.device | None) -> torch.device | None:
    if device_id is None:
        return None
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _materialize(
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    ignored_modules: set[nn.Module],
) -> None:
    """Materialize meta-device states of the modules this unit manages (FSDP1's rules)."""
    modules = list(_managed_modules(module, ignored_modules))
    on_meta = any(
        t.is_meta for m in modules for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None
    )
    if not on_meta:
        return
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(f"param_init_fn must be callable but got {type(param_init_fn).__name__}")
        for m in modules:
            param_init_fn(m)
        return
    with torch.no_grad():
        for m in modules:
            m.to_empty(device=device, recurse=False)
        for m in modules:
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def _move_states(module: nn.Module, device: torch.device, ignored_modules: set[nn.Module]) -> None:
    with torch.no_grad():
        for m in _managed_modules(module, ignored_modules):
            for p in m._parameters.values():
                if p is not None and p.device != device:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)


def _sync_states(tensors: list[Tensor], groups: list[dist.ProcessGroup], device: torch.device) -> None:
    """Every rank takes rank 0's values (rank 0 of each group in turn: shard, then replicate)."""
    with torch.no_grad():
        for group in groups:
            src = dist.get_global_rank(group, 0)
            for t in tensors:
                if t.device.type == "cpu" and _uses_nccl(group):
                    staged = t.detach().to(device)
                    dist.broadcast(staged, src=src, group=group)
                    t.copy_(staged.cpu())
                else:
                    dist.broadcast(t.detach(), src=src, group=group)


def _uses_nccl(group: Any) -> bool:
    """Whether ``group`` is an NCCL group (False for CPU backends and process-group doubles)."""
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return False


def _compute_device(params: list[nn.Parameter], device_id: torch.device | None, group: Any) -> torch.device:
    if device_id is not None:
        return device_id
    for p in params:
        if p.device.type not in ("cpu", "meta"):
            return p.device
    if torch.cuda.is_available() and _uses_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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

    #: marks instances as units for ``engine.wrap`` (already-wrapped detection) and the runtime.
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
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        if not isinstance(strategy, ShardingStrategy):
            raise ValueError(f"sharding_strategy={sharding_strategy!r} must be an engine.ShardingStrategy member")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise ValueError(f"backward_prefetch={backward_prefetch!r} must be a BackwardPrefetch member or None")
        if cpu_offload is None:
            cpu_offload = CPUOffload()
        shard_group, replicate_group = _resolve_groups(strategy, process_group, device_mesh)
        if strategy not in HYBRID_STRATEGIES and shard_group.size() == 1 and strategy != ShardingStrategy.NO_SHARD:
            # One rank holds everything: sharding is NO_SHARD (FSDP1 switches the same way).
            strategy = ShardingStrategy.NO_SHARD

        ignored_mods, ignored_params = self._ignored(module, ignored_modules, ignored_states)
        if auto_wrap_policy is not None:
            from engine import wrap  # another module of the engine; imported late to keep import order free

            root_kwargs = {
                "process_group": (shard_group, replicate_group) if strategy in HYBRID_STRATEGIES else shard_group,
                "sharding_strategy": strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                "mixed_precision": mixed_precision,
                "param_init_fn": param_init_fn,
                "device_id": device_id,
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "use_orig_params": use_orig_params,
                "ignored_states": list(ignored_mods) + list(ignored_params),
            }
            wrap.auto_wrap(module, auto_wrap_policy, FullyShardedDataParallel, ignored_mods, ignored_params, root_kwargs)

        dev_from_id = _device_from_id(device_id)
        init_device = dev_from_id or (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available() and _uses_nccl(shard_group)
            else torch.device("cpu")
        )
        _materialize(module, param_init_fn, init_device, ignored_mods)
        if dev_from_id is not None:
            _move_states(module, dev_from_id, ignored_mods)
        ignored_ids = {id(p) for p in ignored_params}
        params = _managed_params(module, ignored_mods, ignored_ids)
        compute_device = _compute_device(params, dev_from_id, shard_group)
        if sync_module_states:
            groups = [shard_group] + ([replicate_group] if replicate_group is not None else [])
            _sync_states(params + _managed_buffers(module, ignored_mods), groups, compute_device)

        self._fsdp_wrapped_module = module
        #: None until the first forward (or utility) decides; then whether this is the root.
        self._is_root: bool | None = None
        #: shared with every unit of the root's tree at lazy init.
        self._ctx: RootContext | None = None
        #: False inside ``no_sync()``: gradients accumulate unsharded.
        self._sync_gradients = True
        self._training_state = TrainingState.IDLE
        self._compute_device = compute_device
        self._limit_all_gathers = limit_all_gathers
        self._mixed_precision = mixed_precision
        #: FSDP_USE_FULL_PREC_IN_EVAL=1 at construction: in eval mode, ignore mixed precision.
        self._use_full_prec_in_eval = full_prec_in_eval_from_env()
        self._sharding_strategy = strategy
        self._use_orig_params = use_orig_params
        self._cpu_offload = cpu_offload
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config = FullStateDictConfig()
        self._optim_state_dict_config = FullOptimStateDictConfig()
        self._ignored_modules = ignored_mods
        # FSDP1's public state attributes, read by tools and tests written against it.
        self.process_group = shard_group
        self.rank = shard_group.rank()
        self.world_size = shard_group.size()
        self.compute_device = compute_device
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.cpu_offload = cpu_offload
        self.limit_all_gathers = limit_all_gathers
        self._replicate_group = replicate_group
        self._unit: FsdpUnit | None = None
        if params:
            mp = mixed_precision or MixedPrecision()
            handle = FlatParamHandle(
                params,
                module,
                compute_device,
                to_handle_strategy(strategy),
                cpu_offload.offload_params,
                mp.param_dtype,
                mp.reduce_dtype,
                mp.keep_low_precision_grads,
                shard_group,
                use_orig_params,
            )
            handle.shard()
            for p in params:
                setattr(p, _FLATTENED, True)
            if not use_orig_params:
                module.register_parameter(FLAT_PARAM, handle.flat_param)
            self._unit = FsdpUnit(
                handle,
                module_name=type(module).__name__,
                strategy=strategy,
                process_group=shard_group,
                replicate_group=replicate_group,
                offload_params=cpu_offload.offload_params,
                backward_prefetch=backward_prefetch,
                forward_prefetch=forward_prefetch,
                keep_low_precision_grads=mp.keep_low_precision_grads,
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
                if _is_fsdp(item):
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

    def _own_buffers(self, ignored_modules: set[nn.Module]) -> list[Tensor]:
        """Buffers of the modules this unit manages (not those of nested units or ignored modules)."""
        return managed_buffers(_managed_modules(self._fsdp_wrapped_module, ignored_modules))

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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(
                f"FSDP unit wrapping {type(self.module).__name__}: forward inside summon_full_params "
                "is not supported; run forward outside the context (or copy the summoned parameters "
                "into an unwrapped module)"
            )
        if self._is_root is None:
            runtime.lazy_init(self)
        if self._is_root:
            args, kwargs = runtime.root_pre_forward(self, args, kwargs)
        args, kwargs = runtime.pre_forward(self, args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        return runtime.post_forward(self, output)

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
            return [m for m in module.modules() if _is_fsdp(m)]
        roots: list[FullyShardedDataParallel] = []
        inside: set[int] = set()
        for m in module.modules():
            if _is_fsdp(m) and id(m) not in inside:
                roots.append(m)  # type: ignore[arg-type]
                inside.update(id(sub) for sub in m.modules())
        return roots

    @property
    def _flat_param(self) -> nn.Parameter | None:
        """This unit's flat parameter (None for a unit with no parameters of its own), as FSDP1."""
        return self._unit.handle.flat_param if self._unit is not None else None

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._sharding_strategy

    @property
    def training_state(self) -> TrainingState:
        return self._training_state

    def _ensure_root(self, what: str) -> RootContext:
        if self._is_root is None:
            runtime.lazy_init(self)
        if not self._is_root:
            raise RuntimeError(
                f"{what} should only be called on the root FSDP instance, but it was called on a "
                f"nested unit wrapping {type(self.module).__name__}: call it on the outermost "
                "FullyShardedDataParallel"
            )
        units = self._ctx.units
        busy = [u for u in units if u.training_state != TrainingState.IDLE]
        if busy:
            raise RuntimeError(
                f"{what} cannot run during forward or backward (unit {busy[0].module_name} is "
                f"{busy[0].training_state.name}): call it between iterations"
            )
        return self._ctx

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
        from engine.summon import summon_full_params

        with summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of every parameter under this root to a total norm of ``max_norm``
        (norm over all shards); returns the total norm before clipping."""
        from engine.grad_norm import clip_grad_norm

        ctx = self._ensure_root("clip_grad_norm_()")
        return clip_grad_norm(self, ctx, max_norm, norm_type)

    def check_is_root(self) -> bool:
        """Whether this instance is the root of its tree (decided at lazy initialization)."""
        if self._is_root is None:
            runtime.lazy_init(self)
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
