"""Rank jobs of the engine-contract tests (importable by the spawned rank processes)."""

from __future__ import annotations

import os
from typing import Any

from harness.ranks.rank import RankContext

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_environment(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """What an engine reading torchrun's variables sees on this rank, and the node size our engine's
    default hybrid groups take from them."""
    from engine.config import hybrid_node_size

    return {
        "env": {k: os.environ.get(k) for k in LAUNCHER_VARIABLES},
        "ctx": (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size),
        "node_size": hybrid_node_size(ctx.world_size, os.environ.get("LOCAL_WORLD_SIZE"), 0),
    }
