"""The adapter contract for engines that own their training step (DeepSpeed's ``engine.backward`` and
``engine.step``, an optimizer the engine wraps, clipping and accumulation by its own config).

The harness still drives the loop (``harness.compare.training.train_steps``): it feeds every micro-batch, calls
the engine's forward, and reads gradients between backward and step and parameters at the end, by
original parameter name, whatever the engine's layout (``EngineTrainee.read_grads``/``read_params``
return ``ParamSlice`` s). What differs is who owns backward, the optimizer and its step: an
``EngineTrainee`` whose ``owned`` is an ``OwnedStep`` gets no harness optimizer; the harness calls
``owned.backward(loss)`` instead of ``loss.backward()`` and ``owned.step()`` (the engine's step and its
zero_grad) instead of the optimizer's.

Checkpoints of such an engine go through its own hooks (``OwnedStep.save``/``load``): ``sharded`` is the
engine's own format (only that engine loads it) and ``full`` is the neutral full state dict every engine
family reads (``NEUTRAL_FULL_FILE``: ``{"model": {name: full tensor}, "optim": {"state": {name: {key:
value}}, "param_groups": [{..., "params": [names]}]}}``, as torch FSDP1's full optimizer state dict keys
it), which is what cross-engine resume goes through. An adapter declares what it can save and load
(``EngineAdapter.checkpoint_kinds``) so a case it cannot express is ``unsupported`` with its reason,
never an ``error``.

Engines report findings about themselves (a default that does not train like DDP, such as DeepSpeed's
gradient clipping to 1.0) as notes starting with ``FINDING``: a failing case's reason carries them
(``harness.compare.parity.record_from_outcome``), so the report says in one line why, not only where.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

__all__ = ["FINDING", "NEUTRAL_FULL_FILE", "OwnedStep", "findings", "neutral_model_state", "neutral_param_groups",
           "owned_checkpoint_reason"]

#: a note starting with this is a finding: a failing case's reason names it.
FINDING = "finding: "
#: the neutral full checkpoint's file under the checkpoint directory (rank 0 writes it, every rank reads
#: it): the same file and layout ``harness.engines.checkpoint`` writes for FSDP1's and FSDP2's full checkpoints.
NEUTRAL_FULL_FILE = "full.pt"


@dataclass
class OwnedStep:
    """The training step of an engine that owns it, bound to one built engine on one rank."""

    #: backward of a micro-batch's loss (already divided by the micro-batch count, as for every side).
    backward: Callable[[torch.Tensor], Any]
    #: the optimizer step and the gradients' reset, the engine's way.
    step: Callable[[], Any]
    #: ``save(kind, path, rank_context)``: a ``kind`` checkpoint under ``path``; collective. None: none.
    save: Callable[[str, Path, Any], None] | None = None
    #: ``load(kind, path, rank_context, fault)``: into this freshly built engine; collective. None: none.
    load: Callable[[str, Path, Any, str], None] | None = None


def neutral_model_state(model: nn.Module, params: dict[str, torch.Tensor],
                        canonical: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """The neutral full checkpoint's ``model``: ``params`` (each parameter's full value once, by canonical
    name), plus every other name a tied parameter goes by and the persistent buffers (on the CPU), as the
    unwrapped ``model``'s ``state_dict`` names them: torch FSDP1 and our engine load a full state dict
    strictly, and a parameters-only one missed the transformer's tied head and its buffers (Megatron-FSDP
    saved, our engine loaded, on two GPUs). ``canonical`` maps a module path to the canonical name."""
    state = dict(params)
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = canonical(name)
        source = first.setdefault(id(param), key)
        if key not in state and source in state:
            state[key] = state[source]
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state.setdefault(canonical(f"{prefix}.{name}" if prefix else name), buffer.detach().cpu().clone())
    return state


def findings(notes: Sequence[str]) -> list[str]:
    """The findings among a case's notes (each a line starting ``finding: ``), in order, without repeats."""
    return list(dict.fromkeys(n for n in notes if n.startswith(FINDING)))


def neutral_param_groups(groups: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """The neutral checkpoint's ``param_groups``: the optimizer's one group's hyperparameters over every
    trainable parameter, by name (the engines that own their step take one optimizer of one group here)."""
    if len(groups) != 1:
        raise ValueError(f"a neutral full checkpoint holds one parameter group; the optimizer has {len(groups)}")
    return [{**{k: v for k, v in groups[0].items() if k != "params"}, "params": list(names)}]


def owned_checkpoint_reason(saver: str, saver_kinds: tuple[str, ...] | None, loader: str,
                            loader_kinds: tuple[str, ...] | None, kind: str) -> str | None:
    """Why ``loader`` cannot resume ``saver``'s ``kind`` checkpoint where either owns its step (their
    ``checkpoint_kinds``; None: an FSDP engine, whose full checkpoint is the neutral one), or None.

    ``full`` is neutral: any pair that both save and load it. Any other kind is an engine's own format:
    only the engine that saved it loads it.
    """
    for name, kinds in ((saver, saver_kinds), (loader, loader_kinds)):
        if kinds is not None and kind not in kinds:
            offered = ", ".join(kinds) if kinds else "none"
            return f"{name} has no {kind} checkpoint (it saves and loads: {offered})"
    if kind != "full" and saver != loader:
        return (f"a {kind} checkpoint of {saver} is its own format, which only {saver} loads; "
                "cross-engine resume goes through the neutral full checkpoint")
    return None
