"""Groups that refuse CPU tensors, as NCCL's do, on CPU ranks.

NCCL refuses a collective on a CPU tensor ("No backend type associated with device type cpu"); gloo,
on which CI's ranks run, takes it. Inside :func:`groups_refusing_cpu` every collective refuses a CPU
tensor unless it went through a staging rule (the engine's ``engine.collectives.staged``, or the
harness's own copy, ``harness.engines.dtensors.staged``), which here stands for the copy to the group's
accelerator, so a check on CPU ranks fails where a real NCCL node would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from engine import collectives
from harness.engines import dtensors

#: the modules whose ``staged`` the block replaces: the engine's staging rule and the harness's copy.
STAGING = (collectives, dtensors)

#: the collectives the engine issues, with the positions of the tensors they send.
SENT = {"all_gather": 1, "all_gather_into_tensor": 1, "broadcast": 0, "all_reduce": 0, "reduce_scatter_tensor": 1}


def _tensors(value: Any) -> list[Tensor]:
    return [value] if isinstance(value, Tensor) else [v for v in value if isinstance(v, Tensor)]


@contextlib.contextmanager
def groups_refusing_cpu() -> Iterator[list[Tensor]]:
    """Yields the tensors staged so far (a check may assert that staging happened at all)."""
    staged: list[Tensor] = []  # kept alive, so their ids stay theirs while the block runs

    def stage(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        copy = tensor.clone()
        staged.append(copy)
        return copy

    def refusing(name: str, position: int) -> Any:
        real = getattr(dist, name)

        def collective(*args: Any, **kwargs: Any) -> Any:
            ids = {id(t) for t in staged}
            for t in _tensors(args[position]):
                if t.device.type == "cpu" and id(t) not in ids:
                    raise RuntimeError(f"No backend type associated with device type cpu (dist.{name} on a CPU tensor)")
            return real(*args, **kwargs)

        return collective

    with pytest.MonkeyPatch.context() as patch:
        for module in STAGING:
            patch.setattr(module, "staged", stage)
        for name, position in SENT.items():
            patch.setattr(dist, name, refusing(name, position))
        yield staged

