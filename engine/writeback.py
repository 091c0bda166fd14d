"""Adopting user changes to the original parameters and their gradients into the flat buffers.

With ``use_orig_params`` a user (or an optimizer) may replace an original parameter, its
``.data`` or its ``.grad`` between iterations; this mixin of
:class:`~engine.flat_param.FlatParamHandle` copies such changes into ``flat_param`` and
``flat_param.grad`` before the next all-gather, so the flat buffers stay the truth. A change is
seen as a parameter or gradient that no longer shows the storage the handle gave it
(:func:`~engine.param_views.same_storage`); ``FSDP_SKIP_WRITEBACK_CHECK=1`` turns the check off
(the unit decides when to call it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn

from engine.param_views import ParamInfo, ParamViews, _flat_view

__all__ = ["Writeback", "WritebackResult"]


class WritebackResult(NamedTuple):
    """What :meth:`FlatParamHandle.writeback_orig_params` copied into the flat buffers."""

    params: bool
    grads: bool


def _fqn(info: ParamInfo) -> str:
    """An original parameter's name under its unit's module, for error messages."""
    return f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name


class Writeback(ParamViews):
    """The writeback half of :class:`~engine.flat_param.FlatParamHandle` (a mixin)."""

    # Set by FlatParamHandle.__init__.
    _segments_cache: tuple[Any, ...] | None

    def _orig_param_segments(self) -> tuple[tuple[int, int, torch.Size], ...]:
        """Per original parameter: ``(offset, numel, expected shape)`` of its part of
        ``flat_param`` (the local shard, or the whole buffer for NO_SHARD).

        Made once per shard metadata and kept: writeback reads it for every unit before each of
        its all-gathers. Keyed by the metadata object, which ``shard()`` sets (and a test may
        replace to probe another rank's shard).
        """
        infos = self.flat_param._shard_param_infos
        cached = self._segments_cache
        if cached is not None and cached[0] is infos:
            return cached[1]
        if not self.uses_sharded_strategy:
            segments = tuple(
                (start, e.numel, torch.Size(e.shape))
                for e, start in zip(self.layout.params, self.layout.param_offsets())
            )
        else:
            segments = tuple(
                (i.offset_in_shard, i.numel_in_shard, torch.Size([i.numel_in_shard])) if i.in_shard else (0, 0, torch.Size([0]))
                for i in infos
            )
        self._segments_cache = (infos, segments)
        return segments

    def reset_flat_grad_if_all_none(self) -> bool:
        """``flat_param.grad = None`` when every original parameter's ``.grad`` is None (the
        optimizer zeroed them with ``set_to_none``); the cheap part of gradient writeback that
        runs even when the writeback check is skipped. Returns whether it reset."""
        if not self._use_orig_params or self.flat_param.grad is None:
            return False
        if all(p.grad is None for p in self._orig_params):
            self.flat_param.grad = None
            return True
        return False

    @torch.no_grad()
    def writeback_orig_params(self, check_grads: bool = True, check_params: bool = True) -> "WritebackResult":
        """Adopt user changes to the original parameters (``.data`` swapped, ``Parameter``
        replaced) and to their ``.grad`` into ``flat_param`` and ``flat_param.grad``
        (``use_orig_params``; call while the sharded views are registered).

        Returns what was written (parameters, gradients). A changed shape raises ``RuntimeError``: the flat
        layout is fixed at construction. ``check_params=False`` (between forward and backward,
        when the module attributes are compute views) looks only at the gradients of the
        ``Parameter`` objects the optimizer holds.
        """
        if not self._use_orig_params:
            return WritebackResult(False, False)
        flat = self.flat_param
        wrote_params = wrote_grads = False
        orig = list(self._orig_params)
        infos = self._param_infos
        sharded = self.uses_sharded_strategy
        # Looked up once: the loop below runs for every original parameter before each all-gather.
        # Only this loop assigns flat.grad (and then updates both names).
        flat_storage = flat.untyped_storage()
        flat_grad = flat.grad if check_grads else None
        flat_grad_storage = flat_grad.untyped_storage() if flat_grad is not None else None
        all_grads_none = True
        # Segments of flat.grad whose original gradient is None: zeroed only when some other gradient is
        # not None, since when all are None (``zero_grad(set_to_none=True)``, every step) flat.grad is
        # dropped instead, and a zero kernel per parameter would delay the step's first all-gathers.
        unset: list[tuple[int, int]] = []
        for i, (offset, numel, shape) in enumerate(self._orig_param_segments()):
            if check_params:
                info = infos[i]
                current = info.module._parameters.get(info.param_name)
            else:
                current = orig[i]
            if not isinstance(current, nn.Parameter):
                raise RuntimeError(
                    f"Original parameter {_fqn(infos[i])} is no longer an nn.Parameter registered on its module "
                    f"(found {type(current).__name__}): assign an nn.Parameter to change it"
                )
            if check_params and (
                current is not orig[i]
                or (numel > 0 and (current.numel() == 0 or current.untyped_storage() is not flat_storage))
                or current.shape != shape
            ):
                if current.shape != shape:
                    raise RuntimeError(
                        f"Cannot writeback when the parameter shape changes\nExpects {shape} but got "
                        f"{current.shape} for {_fqn(infos[i])}: keep the (sharded) shape the parameter has between "
                        "iterations, or change it inside summon_full_params()"
                    )
                segment = flat.data[offset : offset + numel]
                if numel > 0:
                    segment.copy_(current.detach().reshape(-1) if sharded else _flat_view(current))
                    current.data = self.unflat_views(flat.data)[i] if not sharded else segment
                orig[i] = current
                wrote_params = True
            if not check_grads:
                continue
            grad = current.grad
            if grad is None:
                if flat_grad is not None and numel > 0:
                    unset.append((offset, numel))
                continue
            all_grads_none = False
            same = flat_grad_storage is not None and grad.numel() > 0 and grad.untyped_storage() is flat_grad_storage
            if same or numel == 0:
                continue
            if grad.shape != shape:
                raise RuntimeError(
                    f"Cannot writeback when the gradient shape changes\nExpects {shape} but got "
                    f"{grad.shape} for the gradient of {_fqn(infos[i])}: assign a gradient shaped like the parameter"
                )
            if flat_grad is None:
                flat_grad = torch.zeros_like(flat)
                flat.grad = flat_grad
                flat_grad_storage = flat_grad.untyped_storage()
            flat_grad[offset : offset + numel].copy_(grad.detach().reshape(-1))
            wrote_grads = True
        self._orig_params = tuple(orig)
        if check_grads and flat.grad is not None and orig and all_grads_none:
            # Every original gradient was set to None (``zero_grad()``): so is the flat one.
            flat.grad = None
        else:
            for offset, numel in unset:
                flat.grad[offset : offset + numel].zero_()
            if check_grads and (wrote_params or wrote_grads):
                self.use_sharded_grad_views()
        return WritebackResult(wrote_params, wrote_grads)
