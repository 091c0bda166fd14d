"""One run of cases into one results file, the way every front end runs it.

The plumbing from a selection to recorded cases is one line, and this module is it:

1. ``select_part``: the selection's cases (``harness.run.runner.select_cases``), and the part of them this
   process runs (``--part K/N``, ``harness.run.parts.partition``; all of them without one), with the stored
   selection a resumed file keeps (``harness.run.stored_selection``);
2. ``plan_local_lanes``: the rank pools of this host (``harness.ranks.placement.plan_lanes``), refused when the
   CPU ranks would not fit the memory, with a warning when they crowd the cores;
3. ``RunSession``: the results writer, the cases it still lacks (``todo``), the runner over the lanes
   (``harness.run.runner.CaseRunner``), the progress bar, and the stop on Ctrl-C or a results file that cannot
   be written, with the state a front end reports from (``latest``, ``records``, ``not_run``, ``wall_s``).

``harness run`` (on pools, and rank 0 under torchrun, whose one lane is the world), ``harness nightly`` and
``harness certify`` all run their cases through a ``RunSession``; each keeps only its own messages and exit
statuses. What stays a front end's: opening the writer (each refuses an ``--out`` in its own words) and the
resume line it prints.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cases.case import CaseConfig
from harness.cases.records import FAILING, CaseRecord
from harness.compare.reference_cache import trained_fields
from harness.ranks.mps import MpsDaemon, MpsState
from harness.ranks.placement import Lane
from harness.run.runner import CaseRunner, Progress, Selection, Tee, select_cases
from harness.run.parts import PartError, PartSpec, case_costs, partition, read_costs, resolve_part
from harness.run.stored_selection import StoredSelection, selection_options, write_selection

if TYPE_CHECKING:
    from harness.run.runner import Pool

__all__ = ["Part", "RunSession", "plan_local_lanes", "select_part", "part_text"]


# ---------------------------------------------------------------------------------------------------
# selection -> part


@dataclass(frozen=True)
class Part:
    """The cases a selection names, and the part of them this process runs."""

    selection: Selection
    world_sizes: tuple[int, ...]
    #: every selected case, in selection order (what every part of the selection shares).
    selected: tuple[CaseConfig, ...]
    #: the cases of this part, in selection order; ``selected`` without a part.
    cases: tuple[CaseConfig, ...]
    #: the cut's record for the stored selection (``StoredSelection.part``): index, count, partition and
    #: case ids of this part; None for a whole run.
    cut: dict[str, Any] | None
    #: the selection stored beside a resumed results file; None for a new one.
    stored: StoredSelection | None

    @property
    def stored_selection(self) -> StoredSelection:
        """What the results file stores: the stored one when resuming, else this part's."""
        if self.stored is not None:
            return self.stored
        return StoredSelection(selection_options(self.selection, self.world_sizes), tuple(c.full_id for c in self.selected),
                               self.cut)

    @property
    def id(self) -> str:
        """The selection's id, the same in every part of it (the part is not part of it)."""
        return self.stored_selection.id

    def describe(self) -> str:
        """``part 2/4 of 60 cases (partition ...)``; empty for a whole run."""
        return part_text(self.cut, len(self.selected))

    def store(self, results: Path) -> StoredSelection:
        """Store the selection beside ``results`` (for ``--resume``) unless it came from there; a special
        file (``/dev/null``) has nothing to resume, and a selection that cannot be written is a warning:
        the cases still run, a resume then needs the same options."""
        stored = self.stored_selection
        if self.stored is None and Path(results).is_file():
            try:
                write_selection(results, stored)
            except OSError as exc:
                print(f"warning: cannot store the selection beside {results} ({exc}); --resume will need the same "
                      "options", file=sys.stderr)
        return stored


def select_part(selection: Selection, world_sizes: Sequence[int], *, part: PartSpec | str | None = None,
                part_costs: Path | None = None, stored: StoredSelection | None = None,
                prepare: Callable[[list[CaseConfig]], list[CaseConfig]] | None = None,
                env: Mapping[str, str] | None = None) -> Part:
    """The selection's cases (``prepare`` applied: the nightly's determinism sample) and the part ``part``
    names. Resuming (``stored``), the stored part is kept: a ``part`` naming another part is refused,
    and so is one given to a file of a whole run. Raises ``SelectionError`` or ``PartError``."""
    selected = select_cases(selection, world_sizes)
    if prepare is not None:
        selected = prepare(selected)
    whole = Part(selection, tuple(world_sizes), tuple(selected), tuple(selected), None, stored)
    cases, record = _cut(whole.selected, whole.id, part, part_costs, stored, env)
    return Part(selection, tuple(world_sizes), tuple(selected), tuple(cases), record, stored)


def _cut(cases: Sequence[CaseConfig], selection_id: str, given: PartSpec | str | None, costs_path: Path | None,
         stored: StoredSelection | None, env: Mapping[str, str] | None) -> tuple[list[CaseConfig], dict[str, Any] | None]:
    if costs_path is not None and given is None:
        raise PartError("--part-costs: only balances parts; add --part K/N (or auto)")
    earlier = stored.part if stored is not None else None
    if stored is not None and earlier is None and given is not None:
        raise PartError(f"--resume: --part {given} contradicts the file, which holds a whole run (not a part); "
                         "drop --part to continue it, or choose a new --out")
    if earlier is not None:
        # The stored part is this file's, whatever the cost file says now: the other parts were cut
        # with the costs of then, so recutting could lose or repeat cases.
        spec = resolve_part(given, env) if given is not None else None
        if spec is not None and (spec.index, spec.count) != (earlier["index"], earlier["count"]):
            raise PartError(f"--resume: --part {spec} is another part than the file's (part {earlier['index'] + 1}/"
                             f"{earlier['count']} of partition {earlier.get('partition')}); drop it to continue the "
                             "file, or choose a new --out")
        return _kept(cases, earlier["case_ids"]), earlier
    if given is None:
        return list(cases), None
    spec = resolve_part(given, env)
    assert spec is not None
    measured = read_costs(costs_path) if costs_path is not None else {}
    by_id = {c.full_id: c for c in cases}
    costs = case_costs({i: c.to_dict() for i, c in by_id.items()}, measured)
    cut = partition(list(by_id), spec.count, costs, selection_id, {i: trained_fields(c) for i, c in by_id.items()})
    record = {"index": spec.index, "count": spec.count, "partition": cut.id, "case_ids": list(cut.parts[spec.index]),
              "costs_from": str(costs_path) if costs_path is not None else "estimate",
              "measured": sum(1 for i in by_id if i in measured)}
    return _kept(cases, record["case_ids"]), record


def _kept(cases: Sequence[CaseConfig], ids: Sequence[str]) -> list[CaseConfig]:
    """The ``cases`` whose full ids are among ``ids``, in the selection's order."""
    wanted = set(ids)
    return [c for c in cases if c.full_id in wanted]


def part_text(part: Mapping[str, Any] | None, total: int) -> str:
    """``part 2/4 of 60 cases (partition 0123abcd...)`` for messages; empty for a whole run."""
    if part is None:
        return ""
    return f"part {part['index'] + 1}/{part['count']} of {total} cases (partition {part['partition']})"


# ---------------------------------------------------------------------------------------------------
# lanes


def plan_local_lanes(world_sizes: Sequence[int] | None, backend: str, device: str, pools: int | None,
                     candidates: Sequence[int]) -> tuple[dict[int, list[Lane]], dict[int, str], str | None]:
    """The pools of this host per world size (``harness.ranks.placement.plan_lanes`` over ``candidates`` when
    ``world_sizes`` is None), the world sizes skipped with why, and a warning when CPU ranks crowd the
    cores. Raises ``PlacementError`` when the ranks cannot run here, memory included."""
    from harness.ranks.placement import PlacementError, available_memory, cpu_pool_check, host_facts, n_gpus, plan_lanes

    lanes, skipped = plan_lanes(world_sizes, backend, n_gpus(), candidates, device=device,  # type: ignore[arg-type]
                                host=host_facts(), pools=pools)
    refused, crowded = cpu_pool_check(lanes, os.cpu_count() or 1, available_memory())
    if refused:
        raise PlacementError(refused)
    return lanes, skipped, crowded


# ---------------------------------------------------------------------------------------------------
# the run


class RunSession:
    """Cases run on lanes into one results file: the writer, the runner, the progress, the stop.

    State, all of it explicit: ``latest`` (full id -> the newest record of every case of the file, the
    earlier ones of a resumed file included, kept current, so an exit status covers the whole file),
    ``records`` (what this session wrote, in order), and after ``run``: ``not_run`` (cases not launched,
    with why), ``pools_failed``, ``interrupted``, ``wall_s``, ``progress`` (the verdict counts) and
    ``runner`` (``recorded``, ``lane_errors``). A context manager: leaving it closes the writer.
    """

    def __init__(self, writer: Any, lanes: Mapping[int, Sequence[Lane]], *, case_timeout_s: float,
                 repeat: int = 1, repeat_failures: int = 0, show_progress: bool = True,
                 deadline: float | None = None, budget_s: float | None = None,
                 open_pool: Callable[[Lane], "Pool"] | None = None, interrupt_wait_s: float = 30.0,
                 mps: str = "off") -> None:
        self.writer = writer
        self.lanes = {ws: list(group) for ws, group in lanes.items()}
        self.case_timeout_s = case_timeout_s
        self.repeat, self.repeat_failures = repeat, repeat_failures
        self.show_progress = show_progress
        #: ``time.monotonic()`` after which no case starts (a time budget of ``budget_s`` seconds).
        self.deadline, self.budget_s = deadline, budget_s
        self.open_pool = open_pool
        #: how long a stop waits for the lanes to close their pools (0 under torchrun: its world is the pool).
        self.interrupt_wait_s = interrupt_wait_s
        #: ``--mps`` (``harness.ranks.mps``): the choice, and after ``run`` what the ranks got.
        self.mps_choice = mps
        self.mps = MpsState(False, "off: not run")
        self.latest: dict[str, CaseRecord] = dict(getattr(writer, "resumed", {}))
        self.records: list[CaseRecord] = []
        self.progress: Progress | None = None
        self.runner: CaseRunner | None = None
        self.not_run: list[tuple[CaseConfig, str]] = []
        self.pools_failed = False
        self.interrupted = False
        self.wall_s = 0.0

    def __enter__(self) -> "RunSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.close()

    def reruns(self, rerun_failed: bool) -> set[str]:
        """The recorded cases that run again: with ``rerun_failed`` those whose latest record is not passing."""
        return {i for i, r in self.latest.items() if r.verdict in FAILING} if rerun_failed else set()

    def todo(self, cases: Iterable[CaseConfig], rerun_failed: bool = False) -> list[CaseConfig]:
        """The ``cases`` the file lacks (or reruns, ``reruns``) that a lane of this session can run."""
        rerun = self.reruns(rerun_failed)
        return [c for c in cases if (c.full_id not in self.latest or c.full_id in rerun) and c.world_size in self.lanes]

    def _keep(self, record: CaseRecord) -> None:
        from harness.collect.collector import record_full_id

        self.latest[record_full_id(record)] = record
        self.records.append(record)

    def run(self, cases: Sequence[CaseConfig]) -> None:
        """Run ``cases`` on the lanes, each record written as it ends, then check the file is still the
        one written (deleted after its last record, a summary would name a file that is gone).

        Ctrl-C (or a ``Terminated``) stops every lane, recording nothing more, and is raised again; so is
        the ``ResultWriteError`` of a file that cannot be written. A front end says what to do next. The lanes'
        pools run under CUDA MPS as ``mps`` asks (``harness.ranks.mps.MpsDaemon``; ``MpsError`` for ``--mps on``
        where it cannot run, before any pool starts)."""
        start = time.monotonic()
        # The pools stop (interrupted too) before the daemon they reach does.
        with MpsDaemon(self.mps_choice, self.lanes.values()) as self.mps:
            self.progress = Progress(len(cases), enabled=self.show_progress, deadline=self.deadline)
            self.runner = CaseRunner(Tee(self.writer, self._keep), self.progress, self.deadline, self.case_timeout_s,
                                     repeat=self.repeat, repeat_failures=self.repeat_failures, open_pool=self.open_pool)
            try:
                self.not_run, self.pools_failed = self.runner.run_all(self.lanes, cases, self.budget_s)
                self.writer.check_present()
            except KeyboardInterrupt:
                self.interrupted = True
                self.runner.interrupt(self.interrupt_wait_s)
                raise
            except OSError:  # the results file could not be written: the lanes have stopped, their pools go too
                self.runner.interrupt(self.interrupt_wait_s)
                raise
            finally:
                self.wall_s = time.monotonic() - start
                self.progress.close()

    @property
    def recorded(self) -> int:
        """Cases this session ran and recorded."""
        return self.runner.recorded if self.runner is not None else 0

    @property
    def records_s(self) -> float:
        """Seconds this session's lanes spent writing records (``harness.collect.breakdown``'s ``records``)."""
        return self.runner.records_s if self.runner is not None else 0.0
