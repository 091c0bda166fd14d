"""``--part K/N`` and ``--part-costs FILE`` of ``run``, ``list`` and ``nightly``: the options, and where a
nightly part writes. Which part of the selected cases this process runs, and what a resumed part takes back
from its stored selection, is the library's (``harness.run.session.select_part``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.run.session import part_text
from harness.run.parts import PartError, PartSpec, parse_part, resolve_part

__all__ = ["add_alias", "PARTS_DIR", "add_part_options", "resolve_part", "part_dir", "part_text"]

#: the directory of a night's parts, under the night's own.
PARTS_DIR = "shards"


def _part_value(text: str) -> PartSpec | str:
    """``K/N`` checked where argparse reads it; ``auto`` is resolved later, from the environment."""
    if text.strip() == "auto":
        return "auto"
    try:
        return parse_part(text)
    except PartError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def add_alias(p: argparse.ArgumentParser, alias: str, dest: str, **kw: object) -> None:
    """``alias``, an earlier spelling of the option whose destination is ``dest``, as an option of its own
    (hidden from ``--help``): an error then names the spelling that was typed, as for the selection's aliases."""
    p.add_argument(alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)  # type: ignore[arg-type]


def add_part_options(p: argparse.ArgumentParser, more: str = "") -> None:
    """``--part K/N|auto`` and ``--part-costs FILE``; their earlier spellings ``--shard`` and ``--shard-costs``
    are aliases."""
    add_alias(p, "--shard", "part", type=_part_value, metavar="K/N|auto")
    add_alias(p, "--shard-costs", "part_costs", type=Path, metavar="FILE")
    p.add_argument("--part", dest="part", type=_part_value, default=None, metavar="K/N|auto",
                   help="run only the K-th of N disjoint parts of the selected cases, K counted from 1 (1/4 .. 4/4), "
                        "balanced by cost; every case is in exactly one part. auto: from SLURM_ARRAY_TASK_ID "
                        "(against SLURM_ARRAY_TASK_MIN and _COUNT), JOB_COMPLETION_INDEX with FSDP_PARITY_PART_COUNT, "
                        "or FSDP_PARITY_PART_INDEX (0-based) and FSDP_PARITY_PART_COUNT (earlier names: "
                        "FSDP_PARITY_SHARD_INDEX, _COUNT)" + (f"; {more}" if more else ""))
    p.add_argument("--part-costs", dest="part_costs", type=Path, default=None, metavar="FILE",
                   help="a results file or nightly directory whose wall times balance the parts "
                        "(default: an estimate per case from its world size and steps)")


def part_dir(out: Path, part: PartSpec | None) -> Path:
    """Where a nightly part writes: ``OUT/shards/K-of-N`` (K from 1), so that every part of one night
    sits in one directory for the merge; ``out`` itself for a whole nightly."""
    return out if part is None else out / PARTS_DIR / f"{part.index + 1}-of-{part.count}"
