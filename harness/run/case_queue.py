"""The cases a runner's lanes take, handed out so that each pool's reference cache is hit.

A case's reference and tolerance budgets depend only on what is trained
(``harness.compare.reference_cache.trained_fields``), and every rank process keeps the references it
computed. The default full matrix at world sizes 2 and 4 is 29,120 cases over 56 trained
configurations; 24 pools taking them in turn computed 1,008 references in the generator's order and
1,344 in a sampled order (a 2-GPU nightly sample spent 62 % of its case time on references).

- Without a time budget (``grouped``), ``CaseQueue.take(lane)`` gives a lane the next case of the
  configuration it holds; when that is done, the next configuration no lane holds yet (in the order the
  cases came); when none is left, a share of the configuration with the most cases left: 114 references.
- With a budget the cases keep their sampled order, so that a run cut short is still a sample of the
  whole selection; a lane takes the first case among the next ``window`` whose configuration it has
  computed before, else the next case: 120 references with a window of 128, and no case runs more than
  ``window`` places early.

Only the order in which the cases run changes; each case's record is what it is on any pool.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable, Iterable
from typing import Callable

from harness.cases.case import CaseConfig

__all__ = ["CaseQueue"]


class CaseQueue:
    """Cases taken per lane, by a key (the trained configuration); not thread-safe (the runner holds
    its lock around every call)."""

    def __init__(self, cases: Iterable[CaseConfig], key: Callable[[CaseConfig], Hashable], *, grouped: bool = True,
                 window: int = 1) -> None:
        if window < 1:
            raise ValueError(f"CaseQueue: window={window} must be at least 1")
        self._key = key
        self.grouped = grouped
        self.window = window
        #: grouped: the cases per key, keys in the order their first case came; else one group, in order.
        self._groups: dict[Hashable, collections.deque[tuple[Hashable, CaseConfig]]] = {}
        for case in cases:
            k = key(case)
            self._groups.setdefault(k if grouped else None, collections.deque()).append((k, case))
        #: keys no lane has taken yet (grouped).
        self._unclaimed = collections.deque(self._groups)
        #: grouped: the key each lane takes from.
        self._held: dict[int, Hashable] = {}
        #: in order: the keys each lane computed a reference for.
        self._seen: dict[int, set[Hashable]] = collections.defaultdict(set)

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def take(self, lane: int) -> CaseConfig | None:
        """The next case for ``lane``, or None when every case was taken."""
        if not self.grouped:
            return self._take_in_order(lane)
        group = self._groups.get(self._held.get(lane))
        if not group:
            key = self._claim()
            if key is None:
                return None
            self._held[lane] = key
            group = self._groups[key]
        return group.popleft()[1]

    def _take_in_order(self, lane: int) -> CaseConfig | None:
        queue = self._groups.get(None)
        if not queue:
            return None
        seen = self._seen[lane]
        at = next((i for i, (k, _) in enumerate(itertools.islice(queue, self.window)) if k in seen), 0)
        key, case = queue[at]
        del queue[at]
        seen.add(key)
        return case

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
        self._seen.pop(lane, None)
        key = self._key(case)
        group = key if self.grouped else None
        self._groups.setdefault(group, collections.deque()).appendleft((key, case))
        if self.grouped and key not in self._held.values() and key not in self._unclaimed:
            self._unclaimed.appendleft(key)

    def remaining(self) -> list[CaseConfig]:
        """The cases not taken (configuration by configuration when grouped)."""
        return [case for group in self._groups.values() for _, case in group]
