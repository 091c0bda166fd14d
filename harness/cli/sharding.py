"""``--shard K/N`` and ``--shard-costs FILE`` of ``run``, ``list`` and ``nightly``: which part of the selected
cases this process runs (``harness.shards``), and what a resumed shard takes back from its stored selection."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.case import CaseConfig
from harness.shards import ShardError, ShardSpec, case_costs, parse_shard, partition, read_costs
from harness.stored_selection import StoredSelection

__all__ = ["SHARDS_DIR", "add_sharding", "cut_shard", "resolve_shard", "shard_dir", "shard_text"]

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


def resolve_shard(given: ShardSpec | str | None, env: Mapping[str, str] | None = None) -> ShardSpec | None:
    """``--shard``'s value with ``auto`` read from the environment (``harness.shards.shard_from_env``)."""
    if given == "auto":
        return parse_shard("auto", os.environ if env is None else env)
    assert given is None or isinstance(given, ShardSpec)
    return given


def shard_dir(out: Path, shard: ShardSpec | None) -> Path:
    """Where a nightly shard writes: ``OUT/shards/K-of-N`` (K from 1), so that every shard of one night
    sits in one directory for the merge; ``out`` itself for a whole nightly."""
    return out if shard is None else out / SHARDS_DIR / f"{shard.index + 1}-of-{shard.count}"


def cut_shard(args: Any, cases: Sequence[CaseConfig], selection_id: str,
              stored: StoredSelection | None = None, env: Mapping[str, str] | None = None) -> tuple[list[CaseConfig], dict[str, Any] | None]:
    """The cases of the shard ``args`` names and the shard's record for the stored selection (None and
    every case without ``--shard``). Resuming (``stored``), the stored part is kept: a ``--shard`` naming
    another part is refused, and so is one given to a file of a whole run. Raises ``ShardError``."""
    given = getattr(args, "shard", None)
    costs_path = getattr(args, "shard_costs", None)
    if costs_path is not None and given is None:
        raise ShardError("--shard-costs: only balances shards; add --shard K/N (or auto)")
    earlier = stored.shard if stored is not None else None
    if stored is not None and earlier is None and given is not None:
        raise ShardError(f"--resume: --shard {given} contradicts the file, which holds a whole run (not a shard); "
                         "drop --shard to continue it, or choose a new --out")
    if earlier is not None:
        # The stored part is this file's, whatever the cost file says now: the other shards were cut
        # with the costs of then, so recutting could lose or repeat cases.
        spec = resolve_shard(given, env) if given is not None else None
        if spec is not None and (spec.index, spec.count) != (earlier["index"], earlier["count"]):
            raise ShardError(f"--resume: --shard {spec} is another part than the file's (shard {earlier['index'] + 1}/"
                             f"{earlier['count']} of partition {earlier.get('partition')}); drop it to continue the "
                             "file, or choose a new --out")
        return _kept(cases, earlier["case_ids"]), earlier
    if given is None:
        return list(cases), None
    spec = resolve_shard(given, env)
    assert spec is not None
    measured = read_costs(costs_path) if costs_path is not None else {}
    by_id = {c.full_id: c for c in cases}
    costs = case_costs({i: c.to_dict() for i, c in by_id.items()}, measured)
    part = partition(list(by_id), spec.count, costs, selection_id)
    record = {"index": spec.index, "count": spec.count, "partition": part.id, "case_ids": list(part.parts[spec.index]),
              "costs_from": str(costs_path) if costs_path is not None else "estimate",
              "measured": sum(1 for i in by_id if i in measured)}
    return _kept(cases, record["case_ids"]), record


def _kept(cases: Sequence[CaseConfig], ids: Sequence[str]) -> list[CaseConfig]:
    """The ``cases`` whose full ids are among ``ids``, in the selection's order."""
    wanted = set(ids)
    return [c for c in cases if c.full_id in wanted]


def shard_text(shard: Mapping[str, Any] | None, total: int) -> str:
    """``shard 2/4 of 60 cases (partition 0123abcd...)`` for messages; empty for a whole run."""
    if shard is None:
        return ""
    return f"shard {shard['index'] + 1}/{shard['count']} of {total} cases (partition {shard['partition']})"
