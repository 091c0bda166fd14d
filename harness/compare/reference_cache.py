"""The references a rank has already trained, kept for the cases that would train them again.

A case's reference (DDP or the local model), and under mixed precision or past two ranks its budgets
(the float64 run and the cast ablations, ``harness.compare.tolerance``), depend on what is trained (model, seed,
steps, optimizer, precision as the engine applies it, training loop, checkpoint schedule, world size,
device, the groups a hybrid strategy sums within), never otherwise on how the engine shards it:
strategy, prefetch, offload, ``use_orig_params``, init mode, the engine itself and whether it is compiled.
A nightly walks hundreds of engine configurations per trained configuration, and the reference with its
budgets is most of a case's time (one float64 run and up to three ablated runs beside the engine's one
under mixed precision), so each rank process of a pool keeps them, keyed by ``reference_key``.

Cases with an injected fault or stress delays never use it: their point is what happens on the ranks.
Every rank of a pool runs every case, so the ranks' caches hold the same keys; ``consensus`` still
agrees on a hit collectively, so a rank that failed half-way (and kept nothing) makes every rank
recompute, never one rank skip collectives the others run.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from harness.cases.case import CaseConfig, PrecisionSpec
from harness.compare.compare import Observation
from harness.engines.references import reduce_shard_size

__all__ = ["CachedReference", "ReferenceCache", "cacheable", "consensus", "reference_key", "trained_fields"]

#: fields of ``CaseConfig`` that only change how the engine trains, never what its reference computes.
ENGINE_ONLY_FIELDS = (
    "engine", "sharding_strategy", "backward_prefetch", "forward_prefetch", "cpu_offload", "use_orig_params",
    "init_mode", "resume_engine", "check_determinism", "compile",
)
T = TypeVar("T")

#: references kept per rank process: every trained configuration of a nightly's world size fits.
MAX_ENTRIES = 512


@dataclass(frozen=True)
class CachedReference:
    """What a case computed before its engine ran, and a later case of the same key reuses."""

    reference: Observation
    budgets: dict[str, float]
    resolvable: dict[str, list[str]]
    notes: tuple[str, ...]


def cacheable(case: CaseConfig) -> bool:
    """Whether the case may use the cache (no injected fault, no stress delays)."""
    return case.stress == "none" and "fault" not in case.extra


def reference_key(case: CaseConfig, spec: PrecisionSpec, budget_source: str, device: torch.device,
                  local_world_size: int | None = None) -> tuple[Any, ...]:
    """The case with its engine-only fields at their defaults, the precision the engine applies, where
    the budgets come from (compiled and accumulated cases budget otherwise), the ranks' device, and the
    groups a hybrid strategy sums gradients within (the one thing of the strategy a reference emulates)."""
    shard_size = reduce_shard_size(case, case.world_size, local_world_size)
    return (trained_fields(case), spec, budget_source, str(device), shard_size)


def trained_fields(case: CaseConfig) -> tuple[tuple[str, Any], ...]:
    """The case's fields but ``ENGINE_ONLY_FIELDS``: what its reference trains (the runner's lanes group
    cases by it)."""
    return tuple((f.name, getattr(case, f.name)) for f in dataclasses.fields(case) if f.name not in ENGINE_ONLY_FIELDS)


def consensus(hit: bool, device: torch.device) -> bool:
    """True when every rank of the default group holds the entry (a collective: every rank calls it)."""
    flag = torch.tensor([1 if hit else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class ReferenceCache(Generic[T]):
    """A least-recently-used map from a key (``reference_key``) to what a rank computed (``CachedReference``;
    ``harness.compare.prefetch_baseline`` keeps traces in one), one per rank process."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._entries: collections.OrderedDict[tuple[Any, ...], T] = collections.OrderedDict()
        self.max_entries = max_entries
        self.hits = 0

    def get(self, key: tuple[Any, ...]) -> T | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[Any, ...], entry: T) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (the hit count stays: it counts over the process's life)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
