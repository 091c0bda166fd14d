"""A planted race: our engine with one stream wait left out, as an FSDP1-API namespace (engine ``racy``).

``FullyShardedDataParallel`` here is the built-in engine whose gradient-reduction stream skips its
``wait_stream`` on the compute stream: the reduce-scatter (or all-reduce) reads a gradient the
compute stream may still be writing. On an idle GPU the gradient kernels usually finish before the
host has issued the collective, so the double mostly passes; with ``stress="delay"`` the compute
stream is late every time and the case fails. On CPU there are no streams and it is the built-in
engine. Importing this module registers the engine (``harness.engines.registry.register``) in the
importing process; a pool's ranks import it through ``run_case_with_racy_engine``, the job to send them.
"""

from __future__ import annotations

from typing import Any

import torch

import engine
from engine import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from harness.compare.parity import run_case_on_rank
from harness.engines.adapters import FSDP1Adapter
from harness.engines.registry import register
from harness.ranks.rank import RankContext

__all__ = ["NAME", "BackwardPrefetch", "CPUOffload", "FullyShardedDataParallel", "MixedPrecision",
           "ShardingStrategy", "run_case_with_racy_engine"]

#: the engine name cases use.
NAME = "racy"


class _NoWaitStream(torch.cuda.Stream):
    """A CUDA stream whose ``wait_stream`` does nothing: the one missing synchronization."""

    def wait_stream(self, stream: torch.cuda.Stream) -> None:  # type: ignore[override]
        return None


class FullyShardedDataParallel(engine.FullyShardedDataParallel):
    """The built-in engine, its post-backward stream swapped for ``_NoWaitStream`` after lazy init."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward(*args, **kwargs)
        ctx = self._ctx
        streams = ctx.streams if ctx is not None else None
        if streams is not None and streams.post_backward is not None and not isinstance(streams.post_backward, _NoWaitStream):
            # Shared by every unit of the root: one swap breaks every reduction.
            streams.post_backward = _NoWaitStream(device=ctx.device, priority=-1)
        return output


def run_case_with_racy_engine(ctx: RankContext, case: Any) -> dict[str, Any]:
    """``harness.compare.parity.run_case_on_rank`` on a rank that has imported (and so registered) the double."""
    return run_case_on_rank(ctx, case)


register(NAME, lambda name: FSDP1Adapter(name, __name__))
