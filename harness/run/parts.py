"""Parts of a run: the K-th of N disjoint parts of a selection, balanced by cost; pure, over plain data.

A scheduler (a Slurm job array, a Kubernetes Indexed Job, a CI matrix) starts N copies of one command;
each must run a part of the selected cases such that the parts are disjoint, cover the selection, and
take about the same time. ``partition`` is a pure function of the selected cases in their order, N and
a cost per case: every case goes to exactly one part (longest processing time first: the costliest
case to the least loaded part, ties to the lower part, then the earlier case), and each part keeps the
selection's order. Cases that share work on the ranks go together (``groups``: the session groups them by
trained configuration, ``harness.compare.reference_cache.trained_fields``): a rank process keeps the
references of a trained configuration and the prefetch baselines of the configurations in it, which its cases
reuse only within one part; a group larger than half a part's fair share is cut into runs of consecutive
cases, so that the parts stay balanced within one such run. A case's cost is its wall time in an earlier
results file where one is given (``--part-costs``), else an estimate from its world size and steps
(``estimate_s``), scaled to the measured ones where some are known so that both speak seconds.

Every part records the partition's identity (``Partition.id``: a hash of N, the selection id and the
costs used), so parts cut from different partitions are never merged as one night, and its own case
ids, so that ``--resume`` of a killed part continues exactly its part.

``--part auto`` reads the index and count from the scheduler's environment (``part_from_env``).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COUNT_VARIABLE",
    "EARLIER_VARIABLES",
    "INDEX_VARIABLE",
    "Partition",
    "PartError",
    "PartSpec",
    "case_costs",
    "estimate_s",
    "measured_costs",
    "parse_part",
    "partition",
    "read_costs",
    "resolve_part",
    "part_from_env",
    "units",
]

#: the explicit variables of a CI matrix (and the count of a Kubernetes Indexed Job, which gives none).
INDEX_VARIABLE = "FSDP_PARITY_PART_INDEX"
COUNT_VARIABLE = "FSDP_PARITY_PART_COUNT"
#: their spellings from before "part" replaced "shard", still read when the new one is not set.
EARLIER_VARIABLES = {INDEX_VARIABLE: "FSDP_PARITY_SHARD_INDEX", COUNT_VARIABLE: "FSDP_PARITY_SHARD_COUNT"}

#: seconds of one 5-step case at world size 2 on 2 gloo CPU ranks (measured: 0.41 s over 273 cases).
BASE_CASE_S = 0.41


class PartError(ValueError):
    """A ``--part`` value or scheduler environment that names no valid part; the message says what to change."""


@dataclass(frozen=True)
class PartSpec:
    """One part of N: ``index`` is 0-based here; the command line and every message say ``K/N``, 1-based."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise PartError(f"--part {self.index + 1}/{self.count}: K must be between 1 and N, N at least 1")

    def __str__(self) -> str:
        return f"{self.index + 1}/{self.count}"


def parse_part(text: str, env: Mapping[str, str] | None = None) -> PartSpec:
    """``K/N`` (1-based K) or ``auto`` (from ``env``: ``part_from_env``)."""
    text = text.strip()
    if text == "auto":
        return part_from_env({} if env is None else env)
    k, slash, n = text.partition("/")
    try:
        index, count = int(k), int(n)
    except ValueError:
        raise PartError(f"--part {text!r}: give K/N (the K-th of N parts, K counted from 1, e.g. 1/4) or auto") from None
    if not slash or count < 1 or not 1 <= index <= count:
        raise PartError(f"--part {text}: K must be between 1 and N (K counted from 1, e.g. 1/4 .. 4/4)")
    return PartSpec(index - 1, count)


def resolve_part(given: PartSpec | str | None, env: Mapping[str, str] | None = None) -> PartSpec | None:
    """``--part``'s value: ``K/N`` text parsed, ``auto`` read from the environment (``part_from_env``;
    ``env`` defaults to this process's). Raises ``PartError``."""
    if isinstance(given, str):
        return parse_part(given, os.environ if env is None else env)
    return given


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise PartError(f"--part auto: {name}={env[name]!r} is not an integer") from None


def _set_name(env: Mapping[str, str], name: str) -> str | None:
    """The name under which ``env`` sets ``name`` (``INDEX_VARIABLE`` or ``COUNT_VARIABLE``): itself,
    else its earlier spelling (``EARLIER_VARIABLES``); None when neither is set. Raises ``PartError``
    when both are set to different values."""
    earlier = EARLIER_VARIABLES[name]
    if name in env and earlier in env and env[name].strip() != env[earlier].strip():
        raise PartError(f"--part auto: {name}={env[name]!r} and {earlier}={env[earlier]!r} disagree; "
                        f"set only {name} ({earlier} is its earlier name)")
    return name if name in env else earlier if earlier in env else None


def part_from_env(env: Mapping[str, str]) -> PartSpec:
    """The part a scheduler's environment names, first match wins:

    - explicit ``FSDP_PARITY_PART_INDEX`` (0-based) and ``FSDP_PARITY_PART_COUNT`` (a CI matrix);
    - a Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX`` (0-based) with ``FSDP_PARITY_PART_COUNT``
      (Kubernetes puts the job's completions in no variable: set it from ``spec.completions``);
    - a Slurm job array: ``SLURM_ARRAY_TASK_ID`` counted from ``SLURM_ARRAY_TASK_MIN`` (arrays are often
      1-based, ``--array=1-4``), count ``SLURM_ARRAY_TASK_COUNT``; an array with a step (``0-6:2``)
      numbers its tasks by that step, which is refused rather than guessed.

    ``FSDP_PARITY_SHARD_INDEX`` and ``FSDP_PARITY_SHARD_COUNT``, their earlier names, are read where the
    new one is not set; both set to different values is an error naming both.
    """
    index_name, count_name = _set_name(env, INDEX_VARIABLE), _set_name(env, COUNT_VARIABLE)
    if index_name is not None or "JOB_COMPLETION_INDEX" in env:
        name = index_name or "JOB_COMPLETION_INDEX"
        if count_name is None:
            raise PartError(f"--part auto: {name} is set but {COUNT_VARIABLE} is not; set it to the number of "
                             "parts (for an Indexed Job, its spec.completions)")
        index, count = _int_var(env, name), _int_var(env, count_name)
        where = f"{name}={index}, {count_name}={count}"
    elif "SLURM_ARRAY_TASK_ID" in env:
        missing = [v for v in ("SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT") if v not in env]
        if missing:
            raise PartError(f"--part auto: SLURM_ARRAY_TASK_ID is set but {' and '.join(missing)} not; "
                             "is this an array job (sbatch --array)?")
        task, low, count = (_int_var(env, v) for v in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT"))
        step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
        if step != 1:
            raise PartError(f"--part auto: SLURM_ARRAY_TASK_STEP={step}; submit the array without a step "
                             "(--array=1-N) or pass --part K/N")
        index = task - low
        where = f"SLURM_ARRAY_TASK_ID={task}, SLURM_ARRAY_TASK_MIN={low}, SLURM_ARRAY_TASK_COUNT={count}"
    else:
        raise PartError(f"--part auto: no scheduler variables set (SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX, "
                         f"{INDEX_VARIABLE}/{COUNT_VARIABLE}); pass --part K/N")
    if count < 1 or not 0 <= index < count:
        raise PartError(f"--part auto: {where} name no part: the index must be from 0 to count - 1")
    return PartSpec(index, count)


def estimate_s(case: Mapping[str, Any]) -> float:
    """Seconds one case (a ``CaseConfig.to_dict()``) is expected to take when no run measured it: the
    measured mean of a 5-step case on 2 ranks, scaled by steps and ranks (each rank a process on the
    host), doubled for what trains twice (a determinism check, a checkpointed resume, micro-batches)."""
    factor = int(case.get("steps") or 5) / 5 * int(case.get("world_size") or 2) / 2
    for twice in (case.get("check_determinism"), (case.get("checkpoint") or "none") != "none",
                  (case.get("grad_accum") or "none") != "none"):
        factor *= 2 if twice else 1
    if (case.get("compile") or "none") != "none":
        factor *= 10  # Dynamo traces every unit before the first step
    return BASE_CASE_S * factor


def case_costs(cases: Mapping[str, Mapping[str, Any]], measured: Mapping[str, float]) -> dict[str, float]:
    """The cost of every case (full id -> its ``CaseConfig.to_dict()``): its measured seconds where
    ``measured`` has them, else ``estimate_s`` times the median ratio of measured to estimated seconds over
    the cases that have both (1 when none do), so that estimates and measurements compare."""
    known = [measured[i] / estimate_s(c) for i, c in cases.items() if measured.get(i, 0) > 0]
    scale = statistics.median(known) if known else 1.0
    return {i: float(measured[i]) if measured.get(i, 0) > 0 else estimate_s(c) * scale for i, c in cases.items()}


@dataclass(frozen=True)
class Partition:
    """N disjoint parts of one selection: ``parts[k]`` holds the full ids of part ``k`` (0-based)."""

    count: int
    #: the selection's id (``harness.run.stored_selection.StoredSelection.id``), the same in every part.
    selection_id: str
    #: the cost of every selected case, seconds, rounded as hashed.
    costs: Mapping[str, float]
    parts: tuple[tuple[str, ...], ...]
    #: the runs of cases that went to a part together (each a tuple of full ids), in the order they were placed.
    units: tuple[tuple[str, ...], ...] = ()

    @property
    def id(self) -> str:
        """A hash of N, the selection id, the costs and the cases kept together: equal ids are the same partition."""
        text = json.dumps({"count": self.count, "selection": self.selection_id, "costs": dict(sorted(self.costs.items())),
                           "together": sorted(sorted(u) for u in self.units if len(u) > 1)}, sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def loads(self) -> list[float]:
        """Each part's summed cost."""
        return [sum(self.costs[i] for i in part) for part in self.parts]


def partition(case_ids: Sequence[str], count: int, costs: Mapping[str, float], selection_id: str,
              groups: Mapping[str, Hashable] | None = None) -> Partition:
    """Cut ``case_ids`` (the selection, in order) into ``count`` parts balanced by ``costs`` (seconds per
    full id; every id must have one): longest processing time first over ``units`` (each case alone without
    ``groups``, a group key per full id), which keeps the largest part within 4/3 of the optimum. Deterministic:
    ties go to the earlier unit and the lower part. A part may be empty when there are fewer units than parts."""
    if count < 1:
        raise PartError(f"--part: N={count} must be at least 1")
    if len(set(case_ids)) != len(case_ids):
        raise ValueError("partition: the selection lists a case twice")
    rounded = {i: round(float(costs[i]), 3) for i in case_ids}
    runs = units(case_ids, rounded, count, groups)
    cost = [sum(rounded[i] for i in run) for run in runs]
    order = sorted(range(len(runs)), key=lambda u: (-cost[u], u))
    loads = [0.0] * count
    owner: dict[str, int] = {}
    for u in order:
        part = min(range(count), key=lambda k: (loads[k], k))
        owner.update(dict.fromkeys(runs[u], part))
        loads[part] += cost[u]
    parts = tuple(tuple(i for i in case_ids if owner[i] == k) for k in range(count))
    return Partition(count, selection_id, rounded, parts, tuple(runs[u] for u in order))


def units(case_ids: Sequence[str], costs: Mapping[str, float], count: int,
          groups: Mapping[str, Hashable] | None) -> list[tuple[str, ...]]:
    """What ``partition`` places whole, in the selection's order of their first cases: each case alone without
    ``groups``, else each group's cases, a group costing more than half a part's fair share (``costs``'s sum over
    ``count``) cut into runs of consecutive cases of about that much."""
    if groups is None:
        return [(i,) for i in case_ids]
    members: dict[Hashable, list[str]] = {}
    for i in case_ids:
        members.setdefault(groups[i], []).append(i)
    limit = sum(costs.values()) / count / 2
    out: list[tuple[str, ...]] = []
    for ids in members.values():
        run: list[str] = []
        run_cost = 0.0
        for i in ids:
            if run and run_cost + costs[i] > limit:
                out.append(tuple(run))
                run, run_cost = [], 0.0
            run.append(i)
            run_cost += costs[i]
        out.append(tuple(run))
    return out


def measured_costs(records: Iterable[Any]) -> dict[str, float]:
    """Full id -> ``wall_s`` of the latest record of each case (``harness.collect.collector`` records)."""
    from harness.collect.collector import latest_records

    return {i: float(r.wall_s) for i, r in latest_records(records).items() if r.wall_s and r.wall_s > 0}


#: where a nightly keeps its results, and its parts' (``harness.cli.nightly``): what a cost file names.
_RESULTS_NAME = "results.jsonl"


def read_costs(path: os.PathLike[str] | str) -> dict[str, float]:
    """``measured_costs`` of a results file, or of a nightly directory (its ``results.jsonl`` and its
    parts' ``shards/*/results.jsonl``). Raises ``PartError`` naming ``--part-costs`` when it holds none."""
    from harness.collect.collector import read_records

    path = Path(path)
    files = ([path / _RESULTS_NAME, *sorted(path.glob(f"shards/*/{_RESULTS_NAME}"))] if path.is_dir() else [path])
    files = [f for f in files if f.is_file()]
    if not files:
        raise PartError(f"--part-costs {path}: no results file there; give a results.jsonl or a nightly directory")
    costs = measured_costs(read_records(files)[0])
    if not costs:
        raise PartError(f"--part-costs {path}: no record with a wall time; give the results of a run that finished cases")
    return costs
