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
from typing import Any, get_args

import torch
import torch.nn as nn

from engine import CPUOffload, ShardingStrategy
from harness.adapters import fsdp1_prefetch
from harness.case import FSDP1_STRATEGIES, PrefetchName
from suites.seeds import api as _api

#: the builtin engine's FSDP1 API; the helpers live once, engine-neutral, in ``suites.seeds.api``.
BUILTIN = _api.load_api("builtin")
MODELS = _api.MODELS
_optim = _api.optim
_all_data = _api._all_data


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


#: the strategies one rank session runs (hybrid ones need their own groups: test_hybrid.py).
STRATEGIES = [ShardingStrategy[FSDP1_STRATEGIES[s]] for s in ("full_shard", "shard_grad_op", "no_shard")]


def sweep(model: str, device: torch.device) -> None:
    """Every strategy x use_orig_params x backward prefetch x forward prefetch x offload on ``model``,
    in one rank session; reports every diverging configuration at once."""
    failures = []
    prefetches = [fsdp1_prefetch(BUILTIN, name) for name in get_args(PrefetchName)]
    combos = itertools.product(STRATEGIES, [False, True], prefetches, [False, True], [False, True])
    for i, (strategy, orig, bwd, fwd, offload) in enumerate(combos):
        kwargs = dict(
            sharding_strategy=strategy,
            use_orig_params=orig,
            backward_prefetch=bwd,
            forward_prefetch=fwd,
            cpu_offload=CPUOffload(offload_params=offload),
        )
        # Alternate the two references so each sees every axis value.
        reference = "ddp" if i % 2 else "local"
        try:
            train_parity(model, kwargs, device, reference=reference)
        except AssertionError as e:
            failures.append(f"{reference} {kwargs}: {e}")
    assert not failures, f"{len(failures)} configurations diverged:\n" + "\n".join(failures[:5])
