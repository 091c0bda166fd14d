"""A planted offload bug: our engine leaving one parameter on the GPU under CPU offload (engine ``stray``).

``FullyShardedDataParallel`` here is the built-in engine that, with ``CPUOffload(offload_params=True)``
on a host with CUDA, keeps the first bias the root unit holds itself out of its flat parameter and on
the compute device: the slip of an engine that offloads only what it flattens. The root unit is the
one wrapping a zoo model (the harness's adapters wrap the model last). The ``offload_placement`` knob
check must name that parameter and its device. Without offload, or on CPU, it is the built-in engine.
Importing this module registers the engine (``harness.engines.registry.register``) in the importing process;
a pool's ranks import it through ``run_case_with_stray_engine``, the job to send them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import engine
from engine import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from harness.cases.models import ZooModel
from harness.compare.parity import RankResult, run_case_on_rank
from harness.engines.adapters import FSDP1Adapter, canonical_name
from harness.engines.registry import register
from harness.ranks.rank import RankContext

__all__ = ["NAME", "BackwardPrefetch", "CPUOffload", "FullyShardedDataParallel", "MixedPrecision",
           "ShardingStrategy", "run_case_with_stray_engine", "stray_parameter"]

#: the engine name cases use.
NAME = "stray"


def stray_parameter(model: ZooModel) -> str | None:
    """The canonical name of the parameter the planted bug leaves behind on zoo ``model`` (wrapped
    below its root or not at all): the first bias the root unit holds itself; None if it holds none."""
    inside = {id(p) for unit in model.wrap_units() for p in unit.parameters()}
    for name, p in model.named_parameters():
        if name.endswith("bias") and id(p) not in inside and "_fsdp_wrapped_module" not in name:
            return canonical_name(name)
    return None


class FullyShardedDataParallel(engine.FullyShardedDataParallel):
    """The built-in engine; a root unit under CPU offload leaves ``stray_parameter`` on the GPU."""

    def __init__(self, module: nn.Module, *args: Any, cpu_offload: CPUOffload | None = None, **kwargs: Any) -> None:
        stray: nn.Parameter | None = None
        name = stray_parameter(module) if isinstance(module, ZooModel) else None
        if cpu_offload is not None and cpu_offload.offload_params and torch.cuda.is_available() and name is not None:
            stray = module.get_parameter(name)
            kwargs["ignored_states"] = [*(kwargs.get("ignored_states") or []), stray]
        super().__init__(module, *args, cpu_offload=cpu_offload, **kwargs)
        if stray is not None:
            with torch.no_grad():
                stray.data = stray.data.to(self.compute_device)


def run_case_with_stray_engine(ctx: RankContext, case: Any) -> RankResult:
    """``harness.compare.parity.run_case_on_rank`` on a rank that has imported (and so registered) the double."""
    return run_case_on_rank(ctx, case)


register(NAME, lambda name: FSDP1Adapter(name, __name__))
