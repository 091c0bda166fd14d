"""How a unit's original parameters appear on their modules: views into the flat buffers.

The handle (:mod:`engine.flat_param`) owns the sharded flat parameter and the unsharded compute
leaf; this mixin of :class:`~engine.flat_param.FlatParamHandle` points every original parameter's
module attribute at the right view of one of them, and the gradients likewise:

- sharded views (``use_orig_params``): the original ``Parameter`` objects, 1-D slices of the local
  shard between iterations (the optimizer steps them);
- compute views: plain ``Tensor`` views of the unsharded leaf during forward and backward
  (autograd flows into the leaf);
- unsharded ``Parameter`` views for ``summon_full_params``.

A view remembers nothing of its own: whether the user replaced a parameter or its data is read
from the storage each one shows (:func:`same_storage`), which the handle chose when it installed
the view.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from engine.layout import FlatLayout

__all__ = ["ParamInfo", "ParamViews", "SharedParamInfo", "same_storage"]


class ParamInfo(NamedTuple):
    """Where an original parameter is registered: ``getattr(module, param_name)``."""

    param_name: str
    module: nn.Module
    module_name: str


class SharedParamInfo(NamedTuple):
    """A second (or later) registration of a parameter already in the flat parameter."""

    param_name: str
    module: nn.Module
    module_name: str
    prim_param_name: str
    prim_module: nn.Module
    prim_module_name: str


def same_storage(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share one storage object (the one the handle gave a view); a
    parameter whose ``.data`` the user replaced has another."""
    return a.untyped_storage() is b.untyped_storage()


def _is_truly_contiguous(t: Tensor) -> bool:
    # 1x1 channels-last conv weights report both contiguities; only a unit last stride makes a
    # plain ``view`` of the flat segment reproduce the original strides.
    return t.dim() == 0 or (t.stride(-1) == 1 and t.is_contiguous())


def _flat_view(t: Tensor) -> Tensor:
    """The parameter's elements in storage order (what the flat buffer holds)."""
    t = t.detach()
    return t.reshape(-1) if _is_truly_contiguous(t) else t.as_strided((t.numel(),), (1,))


def _set_tensor_attr(module: nn.Module, name: str, value: Tensor) -> None:
    """Register ``value`` as a plain tensor attribute, removing a parameter of that name."""
    module._parameters.pop(name, None)
    setattr(module, name, value)


def _set_param_attr(module: nn.Module, name: str, param: nn.Parameter) -> None:
    if name in module.__dict__:
        delattr(module, name)
    module._parameters[name] = param


class ParamViews:
    """The view-management half of :class:`~engine.flat_param.FlatParamHandle` (a mixin)."""

    # Set by FlatParamHandle.__init__.
    layout: FlatLayout
    #: the handle's FlatParameter (its ``_shard_param_infos`` say what the local shard holds).
    flat_param: nn.Parameter
    unsharded_flat_param: Tensor | None
    _use_orig_params: bool
    _param_infos: tuple[ParamInfo, ...]
    _shared_param_infos: tuple[SharedParamInfo, ...]
    _orig_params: tuple[nn.Parameter, ...]
    _shared_orig_params: tuple[nn.Parameter, ...]
    _param_requires_grad: tuple[bool, ...]
    uses_sharded_strategy: bool
    _sharded_views_cache: tuple[Any, ...] | None

    def unflat_views(self, flat: Tensor) -> list[Tensor]:
        """Views into ``flat`` (an unsharded flat tensor, padded or not) shaped like each original
        parameter. Differentiable when ``flat`` requires grad."""
        layout = self.layout
        total, numel = layout.total_numel, flat.numel()
        if numel < total:
            raise ValueError(
                f"unflat_views needs an unsharded tensor of at least {total} elements, got {numel}"
            )
        # One split, not a narrow per parameter: autograd then gives the leaf its gradient with
        # one concatenation, where per-parameter narrows would each materialize (zero-fill and add)
        # a gradient the size of the whole flat buffer. (``split_with_sizes`` is what ``split``
        # calls for a list of sizes, without its Python wrapper.)
        segments = flat.split_with_sizes([*layout.numels_with_padding, numel - total])
        return [
            segments[j].view(entry.shape) if entry.contiguous else segments[j].as_strided(entry.shape, entry.stride)
            for j, entry in zip(layout.param_segment_indices, layout.params)
        ]

    def use_unsharded_views(self, as_params: bool, source: Tensor | None = None) -> None:
        """Point every original parameter's module attribute at a view of the unsharded buffer.

        ``as_params=False`` (compute) registers plain ``Tensor`` views so autograd flows into the
        unsharded leaf; ``as_params=True`` (``summon_full_params``) registers ``nn.Parameter``s,
        the original objects when ``use_orig_params`` so optimizer references stay valid.
        """
        source = self.unsharded_flat_param if source is None else source
        if source is None:
            raise RuntimeError(f"{self!r}: no unsharded flat parameter to take views of")
        with torch.enable_grad():
            views = self.unflat_views(source)
        for i, (view, info) in enumerate(zip(views, self._param_infos)):
            if as_params and self._use_orig_params:
                param = self._orig_params[i]
                param.data = view.detach()
                _set_param_attr(info.module, info.param_name, param)
            elif as_params:
                _set_param_attr(
                    info.module, info.param_name, nn.Parameter(view.detach(), requires_grad=self._param_requires_grad[i])
                )
            else:
                _set_tensor_attr(info.module, info.param_name, view)
        for j, info in enumerate(self._shared_param_infos):
            prim = getattr(info.prim_module, info.prim_param_name)
            if as_params and self._use_orig_params:
                shared = self._shared_orig_params[j]
                shared.data = prim.data
                _set_param_attr(info.module, info.param_name, shared)
            elif as_params:
                _set_param_attr(info.module, info.param_name, prim)
            else:
                _set_tensor_attr(info.module, info.param_name, prim)

    @torch.no_grad()
    def use_sharded_views(self) -> None:
        """Make each original parameter a 1-D view of its part of the local shard (``use_orig_params``).

        A parameter with nothing in this shard gets a size-0 tensor; the ``Parameter`` objects are
        the originals, so optimizers built over them keep stepping the shard.
        """
        if not self._use_orig_params:
            raise RuntimeError(f"{self!r}: sharded views exist only with use_orig_params=True")
        if not self.uses_sharded_strategy:
            for i, (view, info) in enumerate(zip(self.unflat_views(self.flat_param), self._param_infos)):
                self._orig_params[i].data = view
                _set_param_attr(info.module, info.param_name, self._orig_params[i])
            self._register_shared_orig_params()
            return
        for param, info, view in zip(self._orig_params, self._param_infos, self._sharded_data_views()):
            param.data = view
            _set_param_attr(info.module, info.param_name, param)
        self._register_shared_orig_params()

    def _sharded_data_views(self) -> tuple[Tensor, ...]:
        """Each original parameter's 1-D slice of the local shard (size 0 where it has none there).

        Made once per shard storage and metadata and kept: every reshard points the parameters back at
        these slices (twice a step per unit under FULL_SHARD), and slicing anew each time was most of
        that cost. ``param.data = view`` copies the view's geometry into the parameter, so a parameter
        never aliases the kept slice itself. Keyed by the shard's storage object (a move or a
        ``flat_param.data`` swap makes a new one), its offset, size and dtype, and the shard metadata
        object (``shard()`` sets it; a test may replace it).
        """
        flat = self.flat_param
        infos = flat._shard_param_infos
        storage = flat.untyped_storage()
        where = (flat.storage_offset(), flat.numel(), flat.dtype)
        cached = self._sharded_views_cache
        if cached is not None and cached[0] is storage and cached[1] is infos and cached[2] == where:
            return cached[3]
        data = flat.data
        empty = data.new_empty(0)
        views = tuple(
            data[i.offset_in_shard : i.offset_in_shard + i.numel_in_shard] if i.in_shard else empty for i in infos
        )
        self._sharded_views_cache = (storage, infos, where, views)
        return views

    def _register_shared_orig_params(self) -> None:
        for shared, info in zip(self._shared_orig_params, self._shared_param_infos):
            prim = getattr(info.prim_module, info.prim_param_name)
            shared.data = prim.data
            _set_param_attr(info.module, info.param_name, shared)

    def shard_views(self, shard: Tensor) -> list[Tensor | None]:
        """For a tensor shaped like the local shard (its gradient, say), each original parameter's
        1-D part of it, or None where the parameter is not in this shard."""
        return [
            shard[i.offset_in_shard : i.offset_in_shard + i.numel_in_shard] if i.in_shard else None
            for i in self.flat_param._shard_param_infos
        ]

    @torch.no_grad()
    def use_sharded_grad_views(self) -> None:
        """Expose ``flat_param.grad`` through the original parameters' ``.grad`` (``use_orig_params``)."""
        grad = self.flat_param.grad
        views = self.shard_views(grad) if (grad is not None and self.uses_sharded_strategy) else None
        if grad is not None and not self.uses_sharded_strategy:
            views = self.unflat_views(grad)
        for i, param in enumerate(self._orig_params):
            view = None if views is None else views[i]
            if view is None or not param.requires_grad:
                param.grad = None
            elif view.dtype != param.dtype:
                # Low-precision gradients (keep_low_precision_grads) on full-precision parameters:
                # autograd forbids the dtype mismatch through ``.grad =``, so go through ``.data``.
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                param.grad.data = view.view(param.shape)
            else:
                # A view already shaped like its parameter is installed as it is: a fresh view of the
                # gradient either way, one view op less per parameter and step.
                param.grad = view if view.shape == param.shape else view.view(param.shape)
        for shared, info in zip(self._shared_orig_params, self._shared_param_infos):
            prim = getattr(info.prim_module, info.prim_param_name)
            if shared is not prim:
                shared.grad = prim.grad

    # ------------------------------------------------------------------ runtime views
    def param_needs_grad(self, i: int) -> bool:
        """Whether original parameter ``i`` is trainable now (with ``use_orig_params`` a user may
        freeze a parameter after wrapping)."""
        if self._use_orig_params:
            return self._orig_params[i].requires_grad
        return self.flat_param.requires_grad

    def _use_unsharded_views(self, as_params: bool) -> None:
        """The runtime's switch to compute views of the unsharded leaf (``as_params=False``).

        Compute views are plain ``Tensor``s (autograd flows into the leaf); frozen parameters'
        views are detached so no gradient is computed for them. With ``use_orig_params`` the
        views are registered in ``module._parameters`` so ``named_parameters()`` inside forward
        yields the original names and shapes. The views are remembered
        (``compute_views``) so a change between forward and backward can be detected.
        """
        if as_params:
            self.use_unsharded_views(as_params=True)
            return
        leaf = self.unsharded_flat_param
        if leaf is None:
            raise RuntimeError(f"{self!r}: no unsharded flat parameter to take views of")
        with torch.enable_grad():
            views = self.unflat_views(leaf)
        orig_params = self._use_orig_params
        # ``param_needs_grad`` for every parameter at once (this runs for every unit at every unshard).
        needs_grad = [p.requires_grad for p in self._orig_params] if orig_params else None
        flat_needs_grad = self.flat_param.requires_grad
        registered: list[Tensor] = []
        for i, (view, info) in enumerate(zip(views, self._param_infos)):
            if not (needs_grad[i] if needs_grad is not None else flat_needs_grad):
                view = view.detach()
            self._set_compute_attr(info.module, info.param_name, view)
            registered.append(view)
        for info in self._shared_param_infos:
            prim = getattr(info.prim_module, info.prim_param_name)
            self._set_compute_attr(info.module, info.param_name, prim)
            registered.append(prim)
        #: the tensors registered for compute, in param then shared-param order.
        self.compute_views: tuple[Tensor, ...] = tuple(registered)

    def _set_compute_attr(self, module: nn.Module, name: str, view: Tensor) -> None:
        if self._use_orig_params:
            module.__dict__.pop(name, None)
            module._parameters[name] = view  # type: ignore[assignment]
        else:
            _set_tensor_attr(module, name, view)

    def compute_views_changed(self) -> list[str]:
        """FQNs whose registered tensor is no longer the compute view set by
        ``_use_unsharded_views`` (replaced, or its ``.data`` swapped)."""
        views = getattr(self, "compute_views", ())
        leaf = self.unsharded_flat_param
        infos = [(i.module, i.param_name, i.module_name) for i in self._param_infos] + [
            (i.module, i.param_name, i.module_name) for i in self._shared_param_infos
        ]
        changed = []
        for (module, name, module_name), view in zip(infos, views):
            current = module._parameters.get(name, module.__dict__.get(name))
            fqn = f"{module_name}.{name}" if module_name else name
            if current is not view or (view.numel() > 0 and leaf is not None and not same_storage(view, leaf)):
                changed.append(fqn)
        return changed

    @torch.no_grad()
    def use_unsharded_grad_views(self, grad: Tensor) -> None:
        """Expose an unsharded gradient (accumulated under ``no_sync()``) through the original
        parameters' ``.grad``, each shaped like its parameter.

        Between iterations a parameter's data is its sharded (1-D, full-precision, maybe CPU)
        view, so the gradient view can differ in shape, dtype and device; ``.grad =`` refuses
        that, so such gradients are installed through ``.grad.data`` (as torch FSDP1 does).
        """
        if not self._use_orig_params:
            return
        views = self.unflat_views(grad)
        for i, (param, view) in enumerate(zip(self._orig_params, views)):
            if not param.requires_grad:
                param.grad = None
            elif param.shape != view.shape or param.dtype != view.dtype or param.device != view.device:
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                param.grad.data = view
            else:
                param.grad = view
        for shared, info in zip(self._shared_orig_params, self._shared_param_infos):
            prim = getattr(info.prim_module, info.prim_param_name)
            if shared is not prim:
                shared.grad = prim.grad
