"""``--shard K/N`` and ``--shard-costs FILE`` of ``run``, ``list`` and ``nightly``: the options, and where a
nightly shard writes. Which part of the selected cases this process runs, and what a resumed shard takes back
from its stored selection, is the library's (``harness.run.session.select_part``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.run.session import shard_text
from harness.run.shards import ShardError, ShardSpec, parse_shard, resolve_shard

__all__ = ["SHARDS_DIR", "add_sharding", "resolve_shard", "shard_dir", "shard_text"]

#: the directory of a night's shards, under the night's own.
SHARDS_DIR = "shards"


def _shard_value(text: str) -> ShardSpec | str:
    """``K/N`` checked where argparse reads it; ``auto`` is resolved later, from the environment."""
    if text.strip() == "auto":
        return "auto"
    try:
        return parse_shard(text)
    except ShardError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def add_sharding(p: argparse.ArgumentParser, more: str = "") -> None:
    p.add_argument("--shard", type=_shard_value, default=None, metavar="K/N|auto",
                   help="run only the K-th of N disjoint parts of the selected cases, K counted from 1 (1/4 .. 4/4), "
                        "balanced by cost; every case is in exactly one part. auto: from SLURM_ARRAY_TASK_ID "
                        "(against SLURM_ARRAY_TASK_MIN and _COUNT), JOB_COMPLETION_INDEX with FSDP_PARITY_SHARD_COUNT, "
                        "or FSDP_PARITY_SHARD_INDEX (0-based) and FSDP_PARITY_SHARD_COUNT" + (f"; {more}" if more else ""))
    p.add_argument("--shard-costs", type=Path, default=None, metavar="FILE",
                   help="a results file or nightly directory whose wall times balance the parts "
                        "(default: an estimate per case from its world size and steps)")


def shard_dir(out: Path, shard: ShardSpec | None) -> Path:
    """Where a nightly shard writes: ``OUT/shards/K-of-N`` (K from 1), so that every shard of one night
    sits in one directory for the merge; ``out`` itself for a whole nightly."""
    return out if shard is None else out / SHARDS_DIR / f"{shard.index + 1}-of-{shard.count}"
