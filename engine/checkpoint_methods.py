"""torch FSDP1's checkpoint and communication-hook methods, mixed into ``FullyShardedDataParallel``.

The methods are thin: state-dict settings live in :mod:`engine.state_dict_config`, model state
dicts in :mod:`engine.state_dict`, optimizer state in :mod:`engine.optim_state`, hooks in
:mod:`engine.comm_hooks`. The mixin reads each instance's :class:`~engine.state.ModuleState` and the
wrapper's ``check_is_root()``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from engine import optim_state
from engine import state_dict as model_state
from engine import state_dict_config as settings
from engine.api import OptimStateKeyType
from engine.state import fsdp_states

__all__ = ["CheckpointMethods"]


def _broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None) -> Any:
    holder = [obj if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return holder[0]


def _require_optim(optim: torch.optim.Optimizer | None, what: str) -> torch.optim.Optimizer:
    if optim is None:
        raise ValueError(f"{what} needs optim=: pass the optimizer the state is for (optim_input is not supported)")
    return optim


class CheckpointMethods:
    """State-dict types, model and optimizer state dicts, and communication hooks."""

    # ------------------------------------------------------------------ settings
    # FSDP1's static methods are the module's functions themselves: one signature, one docstring.
    state_dict_type = staticmethod(settings.state_dict_type)
    set_state_dict_type = staticmethod(settings.set_state_dict_type)
    get_state_dict_type = staticmethod(settings.get_state_dict_type)

    # ------------------------------------------------------------------ model
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the active type (see :mod:`engine.state_dict`); a bad one changes nothing."""
        if assign:
            raise ValueError("load_state_dict(assign=True) is not supported by FSDP: the flat shards are copied into")
        return model_state.load_model_state_dict(self, state_dict, strict)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ optimizer
    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The optimizer's state keyed by clean FQN, full or sharded per the model's state-dict type."""
        full, rank0_only, offload = optim_state.optim_settings(model)
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        return optim_state.consolidate(model, optim, osd, full, rank0_only, offload, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` (from :meth:`optim_state_dict`) in the form ``optim.load_state_dict`` takes."""
        full, rank0_only, _ = optim_state.optim_settings(model)
        if rank0_only:
            optim_state_dict = _broadcast_from_rank0(optim_state_dict, group)
        result = optim_state.flatten_for_load(model, optim, optim_state_dict, full, is_named_optimizer)
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Older API: the full per-FQN state (on rank 0 only by default)."""
        return optim_state.consolidate(model, optim, optim.state_dict(), True, rank0_only, True, group)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """Older API: the per-FQN state as DTensor chunks."""
        return optim_state.consolidate(model, optim, optim.state_dict(), False, False, True, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Older API: a full per-FQN state (on every rank) as this rank's loadable optimizer state."""
        optim = _require_optim(optim, "shard_full_optim_state_dict")
        return optim_state.flatten_for_load(model, optim, full_optim_state_dict, True)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Older API: a sharded per-FQN state as this rank's loadable optimizer state."""
        return optim_state.flatten_for_load(model, optim, sharded_optim_state_dict, False)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Older API: rank 0's full state (others pass None) as every rank's loadable optimizer state."""
        optim = _require_optim(optim, "scatter_full_optim_state_dict")
        if dist.get_rank(group) == 0 and full_optim_state_dict is None:
            raise ValueError("scatter_full_optim_state_dict: rank 0 must pass the full optimizer state dict")
        full = _broadcast_from_rank0(full_optim_state_dict, group)
        return optim_state.flatten_for_load(model, optim, full, True)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-key a per-parameter optimizer state dict by name (``PARAM_NAME``) or by position
        (``PARAM_ID``, the order of ``optim``'s groups or of ``optim_input``/``model.parameters()``)."""
        refs = optim_state.param_refs(model)
        order = [p for g in optim.param_groups for p in g["params"]] if optim is not None else list(optim_input or model.parameters())
        names: list[str] = []
        for p in order:
            ref = refs.get(id(p))
            if ref is None or len(ref.fqns) != 1:
                raise ValueError(
                    "rekey_optim_state_dict maps one name to one parameter, but a parameter stands for "
                    f"{len(ref.fqns) if ref else 0} names (a flat parameter): rekey for the unwrapped model, "
                    "or use FSDP.optim_state_dict with use_orig_params=True"
                )
            names.append(ref.fqns[0])
        to_name = optim_state_key_type == OptimStateKeyType.PARAM_NAME
        mapping: dict[Any, Any] = dict(enumerate(names)) if to_name else {n: i for i, n in enumerate(names)}

        def rekey(key: Any) -> Any:
            return mapping.get(key, key)

        return {
            "state": {rekey(k): v for k, v in optim_state_dict["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [rekey(k) for k in g["params"]]}
                for g in optim_state_dict["param_groups"]
            ],
        }

    # ------------------------------------------------------------------ communication hooks
    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Reduce gradients of every unit under this root with ``hook`` (see :mod:`engine.comm_hooks`);
        register once, before the first forward (torch FSDP1 documents the same rule)."""
        if not self.check_is_root():  # type: ignore[attr-defined]
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        ctx = self._ctx  # type: ignore[attr-defined]
        if ctx is not None and ctx.forward_count > 0:
            raise AssertionError(
                "register_comm_hook must be called before the first forward (units have already reduced "
                "gradients with the built-in reduction): register it right after wrapping"
            )
        states = fsdp_states(self)  # type: ignore[arg-type]
        for s in states:
            if s.config.hybrid:
                raise AssertionError(f"Communication hook is not supported for hybrid strategies: {s.config.strategy}")
            if s.unit is not None and s.unit.comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
            if not callable(hook):
                raise ValueError(f"The communication hook must be callable but got {hook}")
        for s in states:
            if s.unit is not None:
                s.unit.comm_hook = hook
                s.unit.comm_hook_state = state
