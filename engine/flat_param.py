"""The flat parameter: one wrapped unit's original parameters in one padded 1-D buffer.

A :class:`FlatParamHandle` owns, for one unit:

- the *sharded* flat parameter (:class:`FlatParameter`, ``handle.flat_param`` after ``shard()``):
  this rank's equal slice, the tensor the optimizer steps (or, with ``use_orig_params``, the
  storage the original parameters are 1-D views into). It never changes identity after ``shard()``;
- the *unsharded* flat parameter (``handle.unsharded_flat_param``): a separate autograd leaf in the
  compute dtype on the compute device, sized for the all-gather output. Compute reads views into
  it; gradients accumulate on it. Its storage is allocated for compute and freed afterwards, but
  the tensor object persists so views and saved tensors stay valid across a re-gather
  ([Note: one unsharded leaf, storage freed in place]).

The layout arithmetic lives in :mod:`engine.layout` (pure, no tensors); how the original
parameters appear on their modules in :mod:`engine.param_views` and the adoption of user changes to
them in :mod:`engine.writeback` (mixins of the handle). Communication lives in the unit; this
module does no collective, so metadata for any world size can be computed in one process with a
process-group test double that has only ``rank()`` and ``size()``.

[Note: one unsharded leaf, storage freed in place]
FSDP1 swaps ``flat_param.data`` between the shard and the unsharded buffer, so one object's meaning
changes with the phase and state is inferred from ``data_ptr()`` comparisons. Here the two are
different tensors with fixed meaning. Freeing resizes the unsharded leaf's *storage* to zero bytes
and re-gathering resizes it back and writes through ``.data`` (a fresh version counter), so autograd
tensors saved in forward — views of that storage — see the re-gathered values in backward without
tripping the in-place-modification check.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from engine.api import MixedPrecision, ShardingStrategy
from engine.config import RankAndSize, UnitConfig
from engine.layout import FlatLayout, ParamEntry, ShardParamInfo, aligned_numel, build_layout
from engine.param_views import ParamInfo, SharedParamInfo, _flat_view, _is_truly_contiguous
from engine.writeback import Writeback, WritebackResult

__all__ = [
    "FlatParameter",
    "FlatParamHandle",
    "FlatParamShardMetadata",
    "HandleShardingStrategy",
    "ParamInfo",
    "SharedParamInfo",
    "WritebackResult",
]


#: torch FSDP1 passes the handle its own strategy enum; here it is the one strategy enum there is.
HandleShardingStrategy = ShardingStrategy


class FlatParamShardMetadata(NamedTuple):
    """This rank's shard, per original parameter it holds (padding never appears).

    ``param_offsets`` are inclusive ``(start, end)`` in each original parameter's own flattened
    element space.
    """

    param_names: tuple[str, ...]
    param_shapes: tuple[torch.Size, ...]
    param_strides: tuple[tuple[int, ...], ...]
    param_contiguities: tuple[bool, ...]
    param_numels: tuple[int, ...]
    param_offsets: tuple[tuple[int, int], ...]


class FlatParameter(nn.Parameter):
    """The flat parameter of one handle: unsharded and padded until ``shard()``, then the local shard.

    Its metadata is the handle's :class:`~engine.layout.FlatLayout`; the per-rank part is
    ``_shard_param_infos`` (set by ``shard()``; tests may set it to probe other ranks' shards).
    """

    #: the layout this buffer follows (shared with the handle).
    _layout: FlatLayout
    #: what the current shard holds of each original parameter.
    _shard_param_infos: tuple[ShardParamInfo, ...]
    #: right padding of this rank's shard.
    _shard_numel_padded: int

    def __new__(cls, data: Tensor, requires_grad: bool = True) -> "FlatParameter":
        return super().__new__(cls, data, requires_grad)  # type: ignore[arg-type]

    # Read-only views of the layout, named as torch FSDP1's attributes so tools that inspect a
    # flat parameter (checkpoint converters, PyTorch's FSDP tests) read ours the same way.
    @property
    def _fqns(self) -> tuple[str, ...]:
        return tuple(p.fqn for p in self._layout.params)

    @property
    def _shapes(self) -> tuple[torch.Size, ...]:
        return tuple(torch.Size(p.shape) for p in self._layout.params)

    @property
    def _strides(self) -> tuple[tuple[int, ...], ...]:
        return tuple(p.stride for p in self._layout.params)

    @property
    def _contiguities(self) -> tuple[bool, ...]:
        return tuple(p.contiguous for p in self._layout.params)

    @property
    def _numels(self) -> tuple[int, ...]:
        return tuple(p.numel for p in self._layout.params)

    @property
    def _numels_with_padding(self) -> tuple[int, ...]:
        return self._layout.numels_with_padding

    @property
    def _is_padding_mask(self) -> tuple[bool, ...]:
        return self._layout.is_padding_mask

    @property
    def _num_params(self) -> int:
        return len(self._layout.params)


class FlatParamHandle(Writeback):
    """Flattens, shards and unflattens one unit's parameters; owns both flat buffers.

    Arguments and their names are torch FSDP1's, so code written against its ``FlatParamHandle``
    constructs ours unchanged; they become the handle's :class:`~engine.config.UnitConfig`. The
    engine builds its handles from the instance's config instead (:meth:`from_config`).
    ``process_group`` needs only ``rank()`` and ``size()``.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter | Tensor],
        fully_sharded_module: nn.Module,
        device: torch.device,
        sharding_strategy: HandleShardingStrategy,
        offload_params: bool,
        mp_param_dtype: torch.dtype | None,
        mp_reduce_dtype: torch.dtype | None,
        keep_low_precision_grads: bool,
        process_group: RankAndSize,
        use_orig_params: bool,
        *,
        fsdp_extension: Any = None,
    ) -> None:
        if fsdp_extension is not None:
            raise ValueError(
                "FlatParamHandle(fsdp_extension=...) is not supported by this engine: pass None "
                "(tensor-parallel extensions are out of scope)"
            )
        if not isinstance(sharding_strategy, HandleShardingStrategy):
            raise ValueError(
                f"sharding_strategy={sharding_strategy!r} must be a HandleShardingStrategy member"
            )
        mixed = None
        if mp_param_dtype is not None or mp_reduce_dtype is not None or keep_low_precision_grads:
            mixed = MixedPrecision(
                param_dtype=mp_param_dtype, reduce_dtype=mp_reduce_dtype, keep_low_precision_grads=keep_low_precision_grads
            )
        config = UnitConfig(
            strategy=sharding_strategy,
            compute_device=torch.device(device),
            shard_group=process_group,
            offload_params=offload_params,
            mixed_precision=mixed,
            use_orig_params=use_orig_params,
        )
        self._init_from_config(list(params), fully_sharded_module, config)

    @classmethod
    def from_config(
        cls, params: Sequence[nn.Parameter | Tensor], fully_sharded_module: nn.Module, config: UnitConfig
    ) -> "FlatParamHandle":
        """The engine's constructor: the unit's configuration instead of torch FSDP1's scalars."""
        handle = cls.__new__(cls)
        handle._init_from_config(list(params), fully_sharded_module, config)
        return handle

    def _init_from_config(self, params: list[nn.Parameter | Tensor], module: nn.Module, config: UnitConfig) -> None:
        if not params:
            raise ValueError("Cannot construct a FlatParamHandle with an empty parameter list")
        #: the unit's configuration (strategy, devices, dtypes, offload, ``use_orig_params``).
        self.config = config
        #: compute device: where the unsharded parameter lives during forward and backward.
        self.device = config.compute_device
        self.process_group = config.shard_group
        self.rank = self.process_group.rank()
        self.world_size = self.process_group.size()
        self._fully_sharded_module = module

        dtype, requires_grad, _ = self._validate_params(params, module)
        #: dtype of the full-precision (master) parameters.
        self._orig_param_dtype = dtype
        self._init_param_reduce_dtypes(config.param_dtype, config.reduce_dtype)
        # Alignment is in the dtype that is communicated and computed in (FSDP1 aligns only
        # with use_orig_params, where the original parameters are exposed to the compiler).
        align = aligned_numel(torch.empty((), dtype=self._fwd_bwd_param_dtype).element_size())
        self._aligned_numel = align if config.use_orig_params else 0

        param_infos, shared_infos, unique, shared = self._walk_module_tree(params, module)
        #: original parameters (unique, in flat order) and their later registrations.
        self._param_infos: tuple[ParamInfo, ...] = tuple(param_infos)
        self._shared_param_infos: tuple[SharedParamInfo, ...] = tuple(shared_infos)
        # The original Parameter objects are kept with use_orig_params: the optimizer holds them,
        # so they must survive as views into the flat parameter.
        self._orig_params: tuple[nn.Parameter, ...] = tuple(unique)
        self._shared_orig_params: tuple[nn.Parameter, ...] = tuple(shared)
        self._param_requires_grad: tuple[bool, ...] = tuple(p.requires_grad for p in unique)

        entries = [
            ParamEntry(
                fqn=f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name,
                shape=tuple(p.shape),
                stride=tuple(p.stride()),
                contiguous=_is_truly_contiguous(p),
                numel=p.numel(),
            )
            for p, info in zip(unique, param_infos)
        ]
        self.layout: FlatLayout = build_layout(entries, self.world_size, self._aligned_numel)
        self.flat_param: FlatParameter = self._flatten(unique, requires_grad)
        self._is_sharded = False
        #: the compute-side leaf; created by ``init_unsharded_flat_param()`` at lazy init so that a
        #: ``module.to(dtype)`` between construction and the first forward is honoured. With
        #: parameter mixed precision it is one of ``_compute_leaves``, chosen by ``set_full_precision``.
        self.unsharded_flat_param: Tensor | None = None
        #: one leaf per compute dtype: the low-precision one, and the full-precision one created
        #: the first time full precision in eval is used ([Note: full precision in eval]).
        self._compute_leaves: dict[torch.dtype, Tensor] = {}
        #: True while this unit ignores its mixed precision (``FSDP_USE_FULL_PREC_IN_EVAL``).
        self._force_full_precision = False
        #: derived from the shard and kept (read for every unit at every reshard and writeback check):
        #: ``ParamViews._sharded_data_views``' and ``Writeback._orig_param_segments``' last answer, with its key.
        self._sharded_views_cache: tuple[Any, ...] | None = None
        self._segments_cache: tuple[Any, ...] | None = None
        self.use_unsharded_views(as_params=False, source=self.flat_param)

    # ------------------------------------------------------------------ what the rest of the engine reads
    # torch FSDP1's private names for these settings, read by its tools and by the param_views and
    # writeback mixins.
    @property
    def _sharding_strategy(self) -> ShardingStrategy:
        return self.config.strategy

    @property
    def _offload_params(self) -> bool:
        return self.config.offload_params

    @property
    def _use_orig_params(self) -> bool:
        return self.config.use_orig_params

    @property
    def _keep_low_precision_grads(self) -> bool:
        return self.config.keep_low_precision_grads

    @property
    def orig_params(self) -> tuple[nn.Parameter, ...]:
        """The original parameters, unique, in flat order."""
        return self._orig_params

    @property
    def shared_orig_params(self) -> tuple[nn.Parameter, ...]:
        """Their later registrations (tied weights), one per :attr:`shared_param_infos` entry."""
        return self._shared_orig_params

    @property
    def param_infos(self) -> tuple[ParamInfo, ...]:
        """Where each original parameter is registered (module and attribute name), in flat order."""
        return self._param_infos

    @property
    def shared_param_infos(self) -> tuple[SharedParamInfo, ...]:
        return self._shared_param_infos

    # ------------------------------------------------------------------ construction
    def _validate_params(self, params: list[Tensor], module: nn.Module) -> tuple[torch.dtype, bool, torch.device]:
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        first = params[0]
        for p in params:
            name = names.get(id(p), "<not registered in the module>")
            if isinstance(p, FlatParameter):
                raise ValueError(
                    f"Cannot flatten parameter {name!r}: it is already a FlatParameter; wrap the "
                    "original module instead of an already-wrapped one"
                )
            if not p.is_floating_point():
                raise ValueError(
                    f"Cannot flatten parameter {name!r} of integer dtype {p.dtype}: only floating-point "
                    "parameters can be sharded; register it as a buffer or use ignored_modules"
                )
            if p.dim() == 0:
                raise ValueError(
                    f"Cannot flatten scalar (0-dim) parameter {name!r}: reshape it to shape (1,) "
                    "or register it as a buffer"
                )
            if p.dtype != first.dtype:
                raise ValueError(
                    f"Must flatten tensors with uniform dtype but parameter {name!r} has {p.dtype} "
                    f"and others {first.dtype}: cast the module to one dtype (mixed precision is set "
                    "with MixedPrecision, not per parameter)"
                )
            if p.device != first.device:
                raise ValueError(
                    f"Must flatten tensors on the same device but parameter {name!r} is on {p.device} "
                    f"and others on {first.device}: move the module to one device before wrapping"
                )
            if not self._use_orig_params and p.requires_grad != first.requires_grad:
                raise ValueError(
                    f"Must flatten tensors with uniform requires_grad when use_orig_params=False but "
                    f"parameter {name!r} has requires_grad={p.requires_grad}: wrap frozen and trainable "
                    "parameters in separate units or pass use_orig_params=True"
                )
        return first.dtype, any(p.requires_grad for p in params), first.device

    @staticmethod
    def _walk_module_tree(
        params: list[Tensor], module: nn.Module
    ) -> tuple[list[ParamInfo], list[SharedParamInfo], list[nn.Parameter], list[nn.Parameter]]:
        wanted = {id(p) for p in params}
        first_seen: dict[int, tuple[nn.Module, str, str]] = {}
        infos: list[ParamInfo] = []
        shared_infos: list[SharedParamInfo] = []
        unique: list[nn.Parameter] = []
        shared: list[nn.Parameter] = []
        for module_name, submodule in module.named_modules(remove_duplicate=False):
            for param_name, param in list(submodule._parameters.items()):
                if param is None or id(param) not in wanted:
                    continue
                if id(param) in first_seen:
                    prim_module, prim_module_name, prim_name = first_seen[id(param)]
                    shared_infos.append(
                        SharedParamInfo(param_name, submodule, module_name, prim_name, prim_module, prim_module_name)
                    )
                    shared.append(param)
                else:
                    first_seen[id(param)] = (submodule, module_name, param_name)
                    infos.append(ParamInfo(param_name, submodule, module_name))
                    unique.append(param)
        missing = wanted - set(first_seen)
        if missing:
            raise ValueError(
                f"{len(missing)} of the parameters to flatten are not registered in "
                f"{type(module).__name__}'s module tree: pass only that module's parameters"
            )
        return infos, shared_infos, unique, shared

    @torch.no_grad()
    def _flatten(self, tensors: Sequence[Tensor], requires_grad: bool) -> FlatParameter:
        """Copy ``tensors`` into a new unsharded flat parameter following the layout."""
        dtype, device = tensors[0].dtype, tensors[0].device
        flat = torch.zeros(self.layout.total_numel, dtype=dtype, device=device)
        for t, start in zip(tensors, self.layout.param_offsets()):
            flat.narrow(0, start, t.numel()).copy_(_flat_view(t))
        flat_param = FlatParameter(flat, requires_grad=requires_grad)
        flat_param._layout = self.layout
        flat_param._shard_param_infos = self.layout.shard_param_infos(0, max(self.layout.total_numel - 1, 0))
        flat_param._shard_numel_padded = 0
        return flat_param

    def flatten_tensors(self, tensors: Sequence[Tensor]) -> Tensor:
        """Lay ``tensors`` (one per original parameter, in order) out as the unsharded flat buffer.

        Used for anything shaped like the parameters: gradients, optimizer state, checkpoints.
        """
        if len(tensors) != len(self.layout.params):
            raise ValueError(
                f"flatten_tensors got {len(tensors)} tensors but this handle has "
                f"{len(self.layout.params)} parameters ({', '.join(self.flat_param._fqns)})"
            )
        out = torch.zeros(self.layout.total_numel, dtype=tensors[0].dtype, device=tensors[0].device)
        for t, entry, start in zip(tensors, self.layout.params, self.layout.param_offsets()):
            if t.numel() != entry.numel:
                raise ValueError(
                    f"flatten_tensors: {entry.fqn} has {entry.numel} elements but got a tensor of shape {tuple(t.shape)}"
                )
            out.narrow(0, start, t.numel()).copy_(_flat_view(t))
        return out

    def _init_param_reduce_dtypes(self, mp_param_dtype: torch.dtype | None, mp_reduce_dtype: torch.dtype | None) -> None:
        # FSDP1's rule: a param dtype without a reduce dtype reduces in the param dtype.
        self._low_prec_param_dtype_specified = mp_param_dtype is not None
        self._low_prec_reduce_dtype_specified = mp_reduce_dtype is not None
        if mp_param_dtype is not None and mp_reduce_dtype is None:
            self._fwd_bwd_param_dtype = mp_param_dtype
            self._reduce_dtype = mp_param_dtype
        else:
            self._fwd_bwd_param_dtype = mp_param_dtype or self._orig_param_dtype
            self._reduce_dtype = mp_reduce_dtype or self._orig_param_dtype

    # ------------------------------------------------------------------ sharding & metadata
    @property
    def uses_sharded_strategy(self) -> bool:
        return self.config.sharded

    @torch.no_grad()
    def shard(self) -> None:
        """Replace the flat parameter's data by this rank's shard (once, at construction).

        After this, ``flat_param`` is the local shard for good; with ``use_orig_params`` the
        original parameters become 1-D views into it.
        """
        if self._is_sharded:
            raise RuntimeError(f"{self!r} is already sharded: shard() runs once per handle")
        flat_param = self.flat_param
        if self.uses_sharded_strategy:
            start, end, numel_padded = self.layout.shard_bounds(self.rank)
            local = torch.zeros(self.layout.shard_numel, dtype=flat_param.dtype, device=flat_param.device)
            real = self.layout.shard_numel - numel_padded
            if real > 0:
                local[:real].copy_(flat_param.data[start : start + real])
            unsharded = flat_param.data
            flat_param.data = local
            # The module attributes still view the unsharded buffer: free its storage, or every
            # rank would keep the whole unit resident (the views are re-pointed before use).
            self._free_storage(unsharded)
        else:
            start, end, numel_padded = 0, max(self.layout.total_numel - 1, 0), 0
        if self._offload_params:
            flat_param.data = flat_param.data.cpu()
        flat_param._shard_param_infos = self._get_shard_metadata(start, end)
        flat_param._shard_numel_padded = numel_padded
        self._is_sharded = True
        if self._use_orig_params:
            self.use_sharded_views()

    def _get_shard_metadata(self, unsharded_start_idx: int, unsharded_end_idx: int) -> tuple[ShardParamInfo, ...]:
        """Shard metadata for the inclusive range ``[start, end]`` of the unsharded flat parameter."""
        return self.layout.shard_param_infos(unsharded_start_idx, unsharded_end_idx)

    def shard_metadata(self) -> FlatParamShardMetadata:
        """What this rank's shard (``flat_param._shard_param_infos``) holds, per original parameter."""
        rows = [
            (entry, info)
            for entry, info in zip(self.layout.params, self.flat_param._shard_param_infos)
            if info.in_shard
        ]
        return FlatParamShardMetadata(
            param_names=tuple(e.fqn for e, _ in rows),
            param_shapes=tuple(torch.Size(e.shape) for e, _ in rows),
            param_strides=tuple(e.stride for e, _ in rows),
            param_contiguities=tuple(e.contiguous for e, _ in rows),
            param_numels=tuple(e.numel for e, _ in rows),
            param_offsets=tuple((i.intra_param_start_idx, i.intra_param_end_idx) for _, i in rows),
        )

    # ------------------------------------------------------------------ unsharded buffer
    def init_unsharded_flat_param(self, alias_flat_param: bool = False) -> Tensor:
        """Create the compute-side leaf (storage freed); call once, at lazy init.

        ``alias_flat_param`` (NO_SHARD computing in the flat parameter's own dtype and device):
        the leaf shares the flat parameter's storage instead of holding a copy, so it is never
        freed and needs no gather; the optimizer's in-place steps are what compute sees.
        """
        if self.unsharded_flat_param is not None:
            return self.unsharded_flat_param
        if alias_flat_param:
            if self.uses_sharded_strategy or self.flat_param.dtype != self._fwd_bwd_param_dtype:
                raise RuntimeError(
                    f"{self!r}: only a NO_SHARD handle computing in the parameter dtype can alias "
                    "its flat parameter"
                )
            leaf = self.flat_param.detach()
            leaf.requires_grad_(self.flat_param.requires_grad)
            self.unsharded_flat_param = leaf
            return leaf
        leaf = self._new_compute_leaf(self.param_dtype)
        self.unsharded_flat_param = leaf
        return leaf

    def _new_compute_leaf(self, dtype: torch.dtype) -> Tensor:
        numel = self.layout.padded_unsharded_numel if self.uses_sharded_strategy else self.layout.total_numel
        leaf = torch.empty(numel, dtype=dtype, device=self.device)
        leaf.requires_grad_(self.flat_param.requires_grad)
        self._free_storage(leaf)
        self._compute_leaves[dtype] = leaf
        return leaf

    # ------------------------------------------------------------------ precision
    @property
    def uses_param_mixed_precision(self) -> bool:
        """Whether compute (and the all-gather) run in another dtype than the parameters."""
        return self._fwd_bwd_param_dtype != self._orig_param_dtype

    @property
    def uses_reduce_mixed_precision(self) -> bool:
        return self._reduce_dtype != self._orig_param_dtype

    @property
    def force_full_precision(self) -> bool:
        return self._force_full_precision

    def set_full_precision(self, full: bool) -> Tensor | None:
        """Compute, gather and reduce in the full-precision dtype (``full=True``) or in the
        mixed-precision dtypes; a no-op for a handle without mixed precision.

        Must be called while the unsharded leaf holds no storage (the caller reshards first).
        Returns the full-precision leaf when this call created it, so the caller can register its
        hooks on it; None otherwise.
        """
        full = full and (self.uses_param_mixed_precision or self.uses_reduce_mixed_precision)
        if full == self._force_full_precision:
            return None
        if self.uses_param_mixed_precision and self.unsharded_allocated:
            raise RuntimeError(
                f"{self!r}: cannot switch to {'full' if full else 'mixed'} precision while the "
                "unsharded parameters are allocated; reshard first"
            )
        self._force_full_precision = full
        if not self.uses_param_mixed_precision or self.unsharded_flat_param is None:
            return None
        dtype = self.param_dtype
        leaf = self._compute_leaves.get(dtype)
        created = leaf is None
        if leaf is None:
            leaf = self._new_compute_leaf(dtype)
        self.unsharded_flat_param = leaf
        return leaf if created else None

    @property
    def unsharded_allocated(self) -> bool:
        leaf = self.unsharded_flat_param
        return leaf is not None and leaf.untyped_storage().size() > 0

    def alloc_unsharded_flat_param(self) -> Tensor:
        """Give the unsharded leaf its storage back; returns a ``.data`` alias to write into
        without bumping the leaf's version counter."""
        leaf = self.unsharded_flat_param
        if leaf is None:
            raise RuntimeError(f"{self!r}: call init_unsharded_flat_param() before allocating it")
        nbytes = leaf.numel() * leaf.element_size()
        if leaf.untyped_storage().size() != nbytes:
            leaf.untyped_storage().resize_(nbytes)
        return leaf.data

    def free_unsharded_flat_param(self) -> None:
        if self.unsharded_flat_param is not None:
            self._free_storage(self.unsharded_flat_param)

    @staticmethod
    def _free_storage(t: Tensor) -> None:
        storage = t.untyped_storage()
        if storage.size() > 0:
            storage.resize_(0)

    # ------------------------------------------------------------------ introspection
    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of compute (and of the all-gather) now: full precision while forced."""
        return self._orig_param_dtype if self._force_full_precision else self._fwd_bwd_param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """dtype of the gradient reduction now: full precision while forced."""
        return self._orig_param_dtype if self._force_full_precision else self._reduce_dtype

    def param_module_names(self) -> Iterator[tuple[str, str]]:
        # Every registration, shared ones last (as FSDP1): state dicts need each name of a tied weight.
        for info in (*self._param_infos, *self._shared_param_infos):
            yield info.param_name, info.module_name

    def shared_param_module_names(self) -> Iterator[tuple[str, str]]:
        for info in self._shared_param_infos:
            yield info.param_name, info.module_name

    def __repr__(self) -> str:
        return f"FlatParamHandle(flat_param.fqns={list(self.flat_param._fqns)})"
