"""Training parity of the engine against unsharded references, run inside rank processes.

Two references:
- ``local``: one unsharded copy of the model on every rank that sees *every* rank's batch (the
  concatenation); its loss must equal the mean of the ranks' losses and its parameters the
  wrapped model's full parameters;
- ``ddp``: torch ``DistributedDataParallel`` on the same per-rank batches; the per-rank losses
  must match.
The mixture of experts is compared against the unwrapped model with its declared reduction
(:meth:`MixtureOfExperts.reduce_reference_grads`), per rank.

Optimizer: SGD with momentum (Adam's normalization would hide a gradient scaled by a constant).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn as nn

from engine import ShardingStrategy
from harness.adapters import fsdp1_options
from harness.case import FSDP1_STRATEGIES, CaseConfig, is_hybrid
from harness.matrix import AXES, generate
from suites.seeds import api as _api

#: the builtin engine's FSDP1 API; the helpers live once, engine-neutral, in ``suites.seeds.api``.
BUILTIN = _api.load_api("builtin")


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's full parameters by clean name (cloned inside summon_full_params)."""
    return _api.full_params(BUILTIN, model)


def assert_params_match(model: nn.Module, ref: nn.Module, context: str) -> None:
    _api.assert_params_match(BUILTIN, model, ref, context)


def train_parity(
    model_name: str, fsdp_kwargs: dict[str, Any], device: torch.device, reference: str = "local", steps: int = 5
) -> None:
    """Train the wrapped model and its reference for ``steps`` steps; compare losses every step
    and full parameters at the end."""
    _api.train_parity(BUILTIN, model_name, fsdp_kwargs, device, reference=reference, steps=steps)


def accumulation_parity(
    model_name: str, fsdp_kwargs: dict[str, Any], device: torch.device, use_no_sync: bool, micro_steps: int = 2
) -> None:
    """Accumulate ``micro_steps`` backwards before each optimizer step, the first ones inside
    ``no_sync()``; compare with the local reference accumulating the same micro-batches."""
    _api.accumulation_parity(BUILTIN, model_name, fsdp_kwargs, device, use_no_sync, micro_steps)


#: the matrix's strategies one rank session runs (hybrid ones need their own groups: test_hybrid.py).
STRATEGY_NAMES = [s for s in AXES["sharding_strategy"] if not is_hybrid(s)]
STRATEGIES = [ShardingStrategy[FSDP1_STRATEGIES[s]] for s in STRATEGY_NAMES]

#: The matrix's engine axes (``harness.matrix.AXES``) the sweep crosses, hybrid strategies left out.
SWEEP_AXES = ("sharding_strategy", "use_orig_params", "backward_prefetch", "forward_prefetch", "cpu_offload")
#: The references, in an order that repeats every four configurations: the fastest axis of the product
#: has two values, so plain alternation would give each of its values one reference only.
REFERENCE_CYCLE = ("local", "ddp", "ddp", "local")


def sweep_plan() -> list[tuple[CaseConfig, str]]:
    """The full product of ``SWEEP_AXES`` on the builtin engine at 2 ranks (``harness.matrix.generate``),
    each with its reference from ``REFERENCE_CYCLE``. Only the ``SWEEP_AXES`` fields of a case are read:
    the sweep trains the engine suite's own models."""
    axes = {axis: list(AXES[axis]) for axis in SWEEP_AXES}
    axes["sharding_strategy"] = STRATEGY_NAMES
    cases = generate(
        "full", axes=axes, engine="builtin", reference="local", model=AXES["model"][0], precision="fp32",
        init_mode=AXES["init_mode"][0], world_size=2,
    )
    return list(zip(cases, itertools.cycle(REFERENCE_CYCLE)))


def sweep(model: str, device: torch.device) -> None:
    """Every configuration of ``sweep_plan`` on ``model``, in one rank session; reports every diverging
    configuration at once."""
    failures = []
    for case, reference in sweep_plan():
        kwargs = fsdp1_options(BUILTIN, case)
        try:
            train_parity(model, kwargs, device, reference=reference)
        except AssertionError as e:
            failures.append(f"{reference} {kwargs}: {e}")
    assert not failures, f"{len(failures)} configurations diverged:\n" + "\n".join(failures[:5])
