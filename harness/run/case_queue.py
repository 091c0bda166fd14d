"""The cases a runner's lanes take, handed out so that each pool's reference cache is hit.

A case's reference and tolerance budgets depend only on what is trained
(``harness.compare.reference_cache.trained_fields``), and every rank process keeps the references it
computed. The default full matrix at world sizes 2 and 4 is 29,120 cases over 56 trained
configurations: taken in the generator's order by 24 pools, each pool computes every configuration's
reference once (1,344 references); a lane that keeps taking the configuration it computed last
computes each about once. A 2-GPU nightly sample spent 62 % of its case time on references.

``CaseQueue.take(lane)`` gives a lane the next case of the configuration it holds; when that is done,
the next configuration no lane holds yet (in the order the cases came); when none is left, a share of
the configuration with the most cases left (several lanes then finish it). Only the order in which the
cases run changes; each case's record is what it is on any pool. A run with a time budget takes its
cases in their (sampled) order instead (``grouped=False``): grouping would cut the sample down to the
first configurations.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from typing import Callable

from harness.cases.case import CaseConfig

__all__ = ["CaseQueue"]


class CaseQueue:
    """Cases grouped by a key (the trained configuration), taken per lane; not thread-safe (the runner
    holds its lock around every call)."""

    def __init__(self, cases: Iterable[CaseConfig], key: Callable[[CaseConfig], Hashable], *, grouped: bool = True) -> None:
        self._key = key if grouped else (lambda case: None)
        self._groups: dict[Hashable, collections.deque[CaseConfig]] = {}
        for case in cases:
            self._groups.setdefault(self._key(case), collections.deque()).append(case)
        #: keys no lane has taken yet, in the order their first case came.
        self._unclaimed = collections.deque(self._groups)
        #: the key each lane takes from.
        self._held: dict[int, Hashable] = {}

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def take(self, lane: int) -> CaseConfig | None:
        """The next case for ``lane``, or None when every case was taken."""
        group = self._groups.get(self._held.get(lane))
        if not group:
            key = self._claim()
            if key is None:
                return None
            self._held[lane] = key
            group = self._groups[key]
        return group.popleft()

    def _claim(self) -> Hashable | None:
        while self._unclaimed:
            key = self._unclaimed.popleft()
            if self._groups[key]:
                return key
        busiest = max(self._groups, key=lambda k: len(self._groups[k]), default=None)
        return busiest if busiest is not None and self._groups[busiest] else None

    def put_back(self, lane: int, case: CaseConfig) -> None:
        """A case ``lane`` took but did not run (its pool failed): first again, for another lane."""
        self._held.pop(lane, None)
        key = self._key(case)
        self._groups.setdefault(key, collections.deque()).appendleft(case)
        if key not in self._held.values() and key not in self._unclaimed:
            self._unclaimed.appendleft(key)

    def remaining(self) -> list[CaseConfig]:
        """The cases not taken, configuration by configuration."""
        return [case for group in self._groups.values() for case in group]
