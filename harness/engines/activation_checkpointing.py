"""Activation checkpointing as a case applies it (``CaseConfig.activation_checkpointing``).

The innermost units of a zoo model (units holding no other unit: the transformer's layers, the nested
model's leaves) run under ``torch.utils.checkpoint`` through torch's ``checkpoint_wrapper``, so their
forward runs again inside backward, pre-forward and pre-backward hooks and all-gathers included.

Where the wrapper goes depends on the engine, as each engine's recipes have it: inside an FSDP1 unit
(``FSDP(CheckpointWrapper(layer))``, applied after wrapping), around the module before ``fully_shard``
(FSDP2, as torch's own FSDP2 tests); an FSDP1 case can put the units inside the wrapper instead
(``checkpoint_wrapper(FSDP(layer))``: the ``checkpoint_wrapper`` extra, ``harness.cases.case.FSDP1_EXTRAS``). Recomputing a forward gives the
same numbers, so the references are free to differ: DDP checkpoints non-reentrantly in either mode
(``harness.engines.references.build_ddp`` says why) and the local reference not at all.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from harness.cases.model_protocol import ZooModel

__all__ = ["apply_activation_checkpointing", "checkpointed_units"]


def checkpointed_units(model: ZooModel) -> list[nn.Module]:
    """The units that run under checkpointing: those holding no other unit."""
    units = model.wrap_units()
    ids = {id(u) for u in units}
    return [u for u in units if not any(id(m) in ids for m in u.modules() if m is not u)]


def apply_activation_checkpointing(root: nn.Module, units: list[nn.Module], mode: str) -> None:
    """Put ``units`` (modules somewhere under ``root``) under ``checkpoint_wrapper`` in place, in ``mode``
    (``non_reentrant`` or ``reentrant``; ``none`` does nothing)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_ac

    impls = {"non_reentrant": torch_ac.CheckpointImpl.NO_REENTRANT, "reentrant": torch_ac.CheckpointImpl.REENTRANT}
    if mode not in impls:
        raise ValueError(f"CaseConfig.activation_checkpointing={mode!r} is not one of none, {', '.join(impls)}")
    chosen = {id(u) for u in units}
    torch_ac.apply_activation_checkpointing(
        root,
        checkpoint_wrapper_fn=partial(torch_ac.checkpoint_wrapper, checkpoint_impl=impls[mode]),
        check_fn=lambda m: id(m) in chosen,
    )
