"""The offload placement probe: where an engine keeps parameters and gradients under CPU offload, as a
user sees them, for the ``offload_placement`` knob check (``harness.compare.knobs.check_offload_placement``).

On every rank, ``probe_offload_placement`` builds the case's model afresh through the case's adapter
(same options, strategy, process groups, init mode) and records one training step of it with
``harness.compare.param_devices.record_training_step``: after construction, in forward and backward, after
backward and ``optimizer.step()``, in and after ``summon_full_params`` with and without
``offload_to_cpu``, in and after ``no_sync``, as far as the engine has those utilities
(``harness.engines.adapters.EngineUtilities``: FSDP2 has neither, FSDP1 refuses ``offload_to_cpu`` with
NO_SHARD units); what it cannot ask is reported, never passed.

[Note: a throwaway step, not the compared run]
The compared run is not recorded itself: the recorder drives what that run does not,
``summon_full_params(writeback=True)`` and an accumulation step under ``no_sync``, whose collectives
would land in the trace the sharding and prefetch checks read and whose extra backward and step would
change the trajectory the parity numbers come from. Where an engine puts a parameter is decided by the
configuration (options, strategy, world size), not by the values, so a fresh build of the same case runs
the same placement code. The probe runs after the compared run, outside its trace, under
``torch.random.fork_rng`` (its model and batch come from the case's seed and their own generators, like
every run's), so the parity numbers, the determinism rerun and the RNG streams are what they are without
it. What it cannot see: a misplacement that first appears after a few steps (the ``no_sync`` part does
run a second forward, backward and step).

On CPU ranks the compute device is the CPU, so the probe only shows that every point is recorded; the
check is real where the ranks compute on an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.cases.case import CaseConfig
from harness.cases.dtypes import dtype_of
from harness.cases.models import to_device
from harness.compare.param_devices import PlacementLog, original_names, record_training_step
from harness.compare.training import fresh_model
from harness.engines.adapters import EngineAdapter
from harness.engines.optim import NAMED_OPTIMIZERS, build_optimizer
from harness.ranks.rank import RankContext

__all__ = ["PlacementProbe", "probe_offload_placement"]


@dataclass
class PlacementProbe:
    """What one rank's probe saw: plain data for ``harness.compare.knobs.check_offload_placement``."""

    log: PlacementLog
    #: device type the ranks compute on (``cuda``, ``cpu``).
    compute_device: str
    #: utility (``summon``, ``summon_offload_to_cpu``, ``no_sync``) -> why it was not observed.
    not_observed: dict[str, str] = field(default_factory=dict)


def probe_offload_placement(adapter: EngineAdapter, case: CaseConfig, ctx: RankContext) -> PlacementProbe:
    """One recorded training step of a fresh build of ``case`` (see the module docstring). Collective:
    every rank calls it alike."""
    devices = [ctx.device.index or 0] if ctx.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=ctx.device_type if devices else "cuda"):
        model, _ = fresh_model(case, ctx)
        names = original_names(model)
        inputs = to_device(
            model.get_input(seed=case.seed, step=0, rank=ctx.rank), ctx.device, dtype_of(case.precision_spec.full)
        )
        trainee = adapter.build(case, model, ctx)
        utilities = trainee.utilities
        log = record_training_step(
            trainee.module,
            names,
            # Placement does not depend on how parameters are grouped: the optimizers that split them by name
            # are AdamW-family, probed as one AdamW.
            make_optimizer=lambda params: build_optimizer(
                case.replace(optimizer="adamw") if case.optimizer in NAMED_OPTIMIZERS else case,
                [p for p in params if p.requires_grad]),
            batch=inputs,
            loss_fn=lambda output: model.get_loss(inputs, output),
            summon=utilities.summon,
            summon_offload_to_cpu=utilities.summon_offload_to_cpu,
            no_sync=utilities.no_sync,
        )
    return PlacementProbe(log, ctx.device_type, dict(utilities.missing))
