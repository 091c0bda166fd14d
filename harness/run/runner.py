"""The one case runner every front end shares: select cases, run them on pools, record, show progress.

``select_cases`` turns a ``Selection`` (what the command line or a config asks for) into cases of the
matrix (``harness.selection.sampling.sample_order`` picks a ``--limit``'s cases and orders a time budget's);
``run_case`` runs one case on a pool and decides its record (``run_repeated``:
several runs folded by ``harness.run.repeats``); ``CaseRunner`` drains a queue of cases over several
pools side by side (one thread per pool, see ``harness.ranks.placement.plan_lanes``), writing each record
as it ends; ``Progress`` is the bar (or a line a minute without one) and the per-verdict counts. The
CLI's ``run`` (on pools, or rank 0 under torchrun: ``harness.ranks.torchrun_world``), ``nightly`` and
``certify`` and the pytest plugin all run cases through here.

[Note: the same results whatever the concurrency]
A case's numbers depend only on the case: each pool is its own process group on its own ranks, every
batch and initial parameter is a function of ``(seed, step, rank)``, and a rank's thread count does
not depend on how many pools run (``harness.ranks.pool.PoolConfig.threads_per_rank``). Lanes change which
pool runs a case and when, never what it computes; ``suites/harness`` checks it bitwise on CPU.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from harness.cases.case import CaseConfig
from harness.cases.records import FAILING, CaseRecord
from harness.compare.reference_cache import trained_fields
from harness.ranks.placement import Lane
from harness.run.case_queue import CaseQueue
from harness.run.repeats import merge_runs, needs_rerun
from harness.selection.sampling import sample_order

if TYPE_CHECKING:
    from harness.ranks.pool import RankPool
    from harness.ranks.torchrun_world import TorchrunWorld

    #: what runs a case on every rank of a lane: a rank pool, or the ranks torchrun started.
    Pool = RankPool | TorchrunWorld

__all__ = [
    "CaseRunner",
    "Progress",
    "Selection",
    "Tee",
    "SelectionError",
    "check_selection",
    "exit_status",
    "expected_total",
    "file_counts",
    "generate_cases",
    "lanes_to_start",
    "run_case",
    "run_repeated",
    "select_cases",
    "summary",
    "under_torchrun",
]


@dataclass
class Selection:
    """Which cases of the matrix to run: what ``harness.run.options.SelectionOptions.selection`` makes of the
    options of every front end, and what a results file stores (``harness.run.stored_selection``)."""

    #: case generator of ``harness.selection.matrix``: ``smoke``, ``pairwise`` or ``full``.
    matrix: str = "smoke"
    #: engines under test, names or specs of ``harness.engines.registry`` (None: the matrix's default engines).
    engines: list[str] | None = None
    #: references (None: the matrix's).
    references: list[str] | None = None
    #: models of ``harness.cases.models.MODELS`` (None: the matrix's).
    models: list[str] | None = None
    #: training steps per case (None: ``CaseConfig``'s default).
    steps: int | None = None
    #: optimizers (``harness.selection.matrix.WIDE_AXES``; None: the matrix's, SGD with momentum).
    optimizers: list[str] | None = None
    #: checkpoint types: none, full, sharded, local (None: the matrix's, none).
    checkpoints: list[str] | None = None
    #: training-loop axis (``clip_grad``, ``grad_accum``, ``activation_checkpointing``, ``compile``) -> its
    #: values (``harness.selection.matrix.WIDE_AXES``; an axis left out keeps the matrix's one value).
    loop_axes: dict[str, list[str]] = field(default_factory=dict)
    #: run each engine twice and require bitwise-equal results.
    check_determinism: bool = False
    #: the ``stress`` axis of every case (``delay``: ``--stress``).
    stress: str = "none"
    #: keep cases whose full id contains one of these (``a+b``: contains both ``a`` and ``b``).
    filters: list[str] = field(default_factory=list)
    #: at most this many cases.
    limit: int | None = None


#: Under a time budget a lane may take a case this many places (per lane) past the next one, to reuse a reference
#: its pool computed: 8 (128 places on 16 lanes, 192 on 24) keeps a sampled run's references near one per lane and
#: trained configuration (``harness.run.case_queue``).
LOOKAHEAD_PER_LANE = 8

#: The training-loop axes with an option of their own (``--clip-grad`` ...); ``--loop-axes`` widens them all.
LOOP_OPTION_AXES = ("clip_grad", "grad_accum", "activation_checkpointing", "compile")




class SelectionError(ValueError):
    """The selection options name no valid cases (an unknown engine, model ...)."""


def check_selection(selection: Selection, world_sizes: Sequence[int] = ()) -> None:
    """Refuse a selection naming what does not exist, by the option that names it.

    The one place the names of the selection options are checked, before any case is generated, so
    an error says ``--engines`` rather than the ``CaseConfig`` field it would otherwise fail in.
    """
    from harness.cases.case import ReferenceName
    from harness.cases.models import zoo_names
    from harness.engines.registry import check_engines
    from harness.selection.matrix import _GENERATORS

    def unknown(option: str, given: Sequence[Any] | None, known: Sequence[str], where: str) -> None:
        wrong = [v for v in given or [] if v not in known]
        if wrong:
            raise SelectionError(f"{option}: {', '.join(map(repr, wrong))} not in {where}; choose from {', '.join(known)}")

    unknown("--matrix", [selection.matrix], list(_GENERATORS), "harness.selection.matrix's generators")
    if selection.engines:
        try:
            check_engines(selection.engines, "--engines")
        except ValueError as exc:
            raise SelectionError(str(exc)) from exc
    unknown("--references", selection.references, list(get_args(ReferenceName)), "the references")
    unknown("--models", selection.models, sorted(zoo_names()), "harness.cases.models.MODELS")
    for option, value in (("--steps", selection.steps), ("--limit", selection.limit)):
        if value is not None and value < 1:
            raise SelectionError(f"{option}={value}: must be a positive integer")
    bad_ws = [ws for ws in world_sizes if ws < 1]
    if bad_ws:
        raise SelectionError(f"--world-size {bad_ws}: every world size must be a positive integer")


def select_cases(selection: Selection, world_sizes: Sequence[int]) -> list[CaseConfig]:
    """The cases the selection options name, grouped by world size, in generator order.

    Raises ``SelectionError`` naming the option at fault: an unknown name, or ``--filter`` values
    that match none of the cases (a run of nothing must not look like a green run).
    """
    check_selection(selection, world_sizes)
    try:
        return _select_cases(selection, world_sizes)
    except ValueError as exc:
        raise SelectionError(str(exc)) from exc


def generate_cases(
    matrix: str,
    world_sizes: Sequence[int],
    references: Sequence[str] | None = None,
    axes: Mapping[str, Sequence[Any]] | None = None,
    *,
    judged_on: str | None = None,
    **fixed: Any,
) -> list[CaseConfig]:
    """The cases of generator ``matrix`` (``harness.selection.matrix.generate`` over ``axes``, keywords pinned) for
    every world size and reference, each pinned in turn, without duplicates, in generator order.

    Shared by ``harness run`` and the generated pytest suites (``harness.pytest_plugin.cases``). References
    are pinned in turn because a generator that keeps an axis at its first value (smoke) would
    otherwise never show the second one; None keeps the matrix's reference axis.

    ``judged_on`` (``cpu`` or ``cuda``, where the ranks run): the smoke generator holds only cases the ranks
    there can run and a reference can judge (``harness.compare.parity.smoke_refusal``), each precision against the
    first reference that can judge it; ``harness run``'s smoke selection, README's quick start.
    """
    from harness.selection.matrix import generate

    refuse = None
    if judged_on is not None and matrix == "smoke":
        from harness.compare.parity import smoke_refusal

        refuse = smoke_refusal(judged_on)
    found: dict[str, CaseConfig] = {}
    for ws in world_sizes:
        for reference in references or [None]:
            pinned = {**fixed, "world_size": ws, **({"reference": reference} if reference else {})}
            for case in generate(matrix, axes=axes, refuse=refuse, **pinned):  # type: ignore[arg-type]
                found.setdefault(case.full_id, case)
    return list(found.values())


def run_case(pool: "Pool", case: CaseConfig, timeout_s: float | None = None) -> CaseRecord:
    """Run one case on a started (or lazily starting) pool and decide its all-rank record; ``timeout_s``
    overrides the pool's case timeout for this case."""
    from harness.compare.parity import record_from_outcome, run_case_on_rank

    return record_from_outcome(case, pool.run(run_case_on_rank, case, timeout_s=timeout_s))


def run_repeated(pool: "Pool", case: CaseConfig, repeat: int = 1, repeat_failures: int = 0) -> CaseRecord:
    """``repeat`` runs of ``case``, then ``repeat_failures`` more when they did not all pass, folded
    into one record by ``harness.run.repeats.merge_runs`` (disagreeing runs: ``flaky``)."""
    if repeat < 1 or repeat_failures < 0:
        raise ValueError(f"run_repeated: repeat={repeat} must be >= 1 and repeat_failures={repeat_failures} >= 0")
    runs = [run_case(pool, case) for _ in range(repeat)]
    if repeat_failures and needs_rerun(merge_runs(runs)):
        runs += [run_case(pool, case) for _ in range(repeat_failures)]
    return merge_runs(runs)


def _select_cases(args: Selection, world_sizes: Sequence[int]) -> list[CaseConfig]:
    from harness.engines.registry import check_engines

    axes: dict[str, list[Any]] = {}
    if args.engines:
        axes["engine"] = check_engines(args.engines, "--engines")
    if args.models:
        axes["model"] = args.models
    from harness.selection.matrix import WIDE_AXES

    loop = [(f"--{axis.replace('_', '-')}", axis, values) for axis, values in args.loop_axes.items()]
    for option, axis, values in (("--optimizers", "optimizer", args.optimizers), ("--checkpoints", "checkpoint", args.checkpoints), *loop):
        if values:
            unknown = [v for v in values if v not in WIDE_AXES[axis]]
            if unknown:
                raise ValueError(f"{option}: {unknown} not among {WIDE_AXES[axis]} (dcp-reshard cases name their world "
                                 "sizes: suites/checkpoint builds them)")
            axes[axis] = values
    fixed: dict[str, Any] = {}
    if args.steps is not None:
        fixed["steps"] = args.steps
    if args.check_determinism:
        fixed["check_determinism"] = True
    if args.stress != "none":
        fixed["stress"] = args.stress
    from harness.ranks.placement import n_gpus

    cases = generate_cases(args.matrix, world_sizes, args.references, axes=axes or None,
                           judged_on="cuda" if n_gpus() else "cpu", **fixed)
    if args.filters:
        kept = [c for c in cases if any(all(part in c.full_id for part in f.split("+")) for f in args.filters)]
        if cases and not kept:
            raise SelectionError(
                f"--filter {' --filter '.join(map(repr, args.filters))} matches none of the {len(cases)} selected "
                "cases; `python -m harness list` (same options, without --filter) prints their ids"
            )
        cases = kept
    if args.limit is not None:
        # A limit keeps a sample over every axis, not the generator's first near-identical cases.
        cases = sample_order(cases)[: args.limit]
    return cases


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def expected_total(todo: int, done: int, elapsed_s: float, left_s: float | None) -> int:
    """How many of ``todo`` cases a run will have finished: all of them without a budget, else those
    done plus what the rate so far fits into the ``left_s`` seconds the budget has left."""
    if left_s is None or done == 0 or elapsed_s <= 0:
        return todo
    return min(todo, done + int(done / elapsed_s * max(left_s, 0.0)))


class Tee:
    """A results writer as ``CaseRunner`` sees it that also hands every record to ``keep`` (a front end's
    own view of the run: the latest record per case, the records its judges read)."""

    def __init__(self, writer: Any, keep: Callable[[CaseRecord], None]) -> None:
        self.writer, self.keep = writer, keep

    def append(self, record: CaseRecord) -> None:
        self.writer.append(record)
        self.keep(record)


class Progress:
    """The progress bar and the per-verdict counts; problems are printed above the bar as they come.

    The bar's total is the cases to run and stays so; under a deadline its postfix says when the budget
    ends and how many cases it will have run by then (``expected_total``), and the ETA (``eta_s``) never
    runs past the deadline (tqdm's own, over every case to run, is left out of the bar). Without a bar
    (``--no-progress``, a log file) a status line is printed every ``log_every_s`` seconds instead: cases,
    verdicts, ETA.
    """

    def __init__(self, total: int, enabled: bool, deadline: float | None = None, log_every_s: float | None = 60.0) -> None:
        from tqdm import tqdm

        self.counts: collections.Counter[str] = collections.Counter()
        #: the unsupported cases per reason, for the summary (``summary``).
        self.unsupported: collections.Counter[str] = collections.Counter()
        self.todo = total
        self.deadline = deadline
        self.start = time.monotonic()
        #: cases counted so far (a disabled bar counts nothing).
        self.done = 0
        self.log_every_s = None if enabled else log_every_s
        self._last_log = self.start
        # Under a deadline tqdm's remaining time (every case to run at the rate so far) would run past it.
        shape = {} if deadline is None else {"bar_format": "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"}
        self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, disable=not enabled, file=sys.stderr, **shape)

    def update(self, record: CaseRecord, full_id: str) -> None:
        self.counts[record.verdict] += 1
        if record.verdict == "unsupported":
            self.unsupported[record.reason or "no reason given"] += 1
        self.done += 1
        if record.verdict in FAILING:
            self.bar.write(f"{record.verdict:8s} {full_id}: {record.reason}", file=sys.stderr)
        now = time.monotonic()
        postfix: dict[str, Any] = dict(self.counts)
        if self.deadline is not None:
            postfix["budget"] = f"{max(self.deadline - now, 0):.0f}s left, ~{self.expected(now)} cases"
            postfix["ETA"] = self._eta_text(now)
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if self.log_every_s is not None and now - self._last_log >= self.log_every_s:
            self._last_log = now
            print(self.status_line(now), file=sys.stderr, flush=True)

    def expected(self, now: float) -> int:
        """The cases this run will have run: all of them, or what the budget's rest fits."""
        return expected_total(self.todo, self.done, now - self.start, self.deadline - now if self.deadline is not None else None)

    def eta_s(self, now: float) -> float | None:
        """Seconds until the expected cases are done at the rate so far, never past the deadline; None
        before the first case."""
        elapsed = now - self.start
        if not self.done or elapsed <= 0:
            return None
        eta = (self.expected(now) - self.done) * elapsed / self.done
        return eta if self.deadline is None else min(eta, max(self.deadline - now, 0.0))

    def _eta_text(self, now: float) -> str:
        eta = self.eta_s(now)
        return "?" if eta is None else f"{eta:.0f} s"

    def status_line(self, now: float) -> str:
        """``120/451 cases (pass 117, fail 3); 2.0 cases/s; ETA 166 s``."""
        elapsed = now - self.start
        expected = self.expected(now)
        verdicts = ", ".join(f"{v} {n}" for v, n in self.counts.most_common()) or "none yet"
        eta = self._eta_text(now)
        of = f"{expected} (budget; {self.todo} selected)" if expected < self.todo else str(self.todo)
        return f"{self.done}/{of} cases ({verdicts}); {rate_text(self.done, elapsed)}; ETA {eta}"

    def close(self) -> None:
        self.bar.close()


def rate_text(cases: int, elapsed_s: float) -> str:
    """``12.3 cases/s``."""
    return f"{cases / elapsed_s:.2f} cases/s" if elapsed_s > 0 else "- cases/s"


def summary(counts: collections.Counter[str], out: Path, elapsed: float,
            unsupported: Mapping[str, int] | None = None) -> str:
    """The verdict table of the cases run now, why the unsupported ones are (``unsupported``: cases per
    reason, most first), and their rate: ``12 cases in 30.1 s (0.40 cases/s) -> out``."""
    from tabulate import tabulate

    rows = [(verdict, n) for verdict, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    n = sum(counts.values())
    text = tabulate(rows, headers=("verdict", "cases"))
    if unsupported:
        why = sorted(unsupported.items(), key=lambda kv: (-kv[1], kv[0]))
        text += "\n\n" + tabulate([(count, reason) for reason, count in why], headers=("unsupported", "because"))
    return f"{text}\n{n} cases in {elapsed:.1f} s ({rate_text(n, elapsed)}) -> {out}"


def exit_status(counts: Mapping[str, int]) -> int:
    """1 when any count of a ``harness.cases.records.FAILING`` verdict is non-zero, else 0."""
    return 1 if any(counts.get(v, 0) for v in FAILING) else 0


def file_counts(latest: Mapping[str, CaseRecord]) -> collections.Counter[str]:
    """Verdict counts over the latest record of every case of a results file (``collector.latest_records``):
    what a resumed run's exit status must reflect, the cases run before the resume included."""
    return collections.Counter(record.verdict for record in latest.values())


def lanes_to_start(lanes: Sequence[Lane], cases: Sequence[CaseConfig]) -> list[Lane]:
    """The lanes of one world size that start a pool for its ``cases``: no more than there are cases (2 cases
    on 16 planned pools started all 16, 32 CUDA processes, for nothing), the first ones, which the plan lists
    group by group so they spread over the GPUs."""
    return list(lanes)[:len(cases)]


class CaseRunner:
    """Runs cases on several pools at once (one thread per pool) and records each as it ends.

    The threads only wait on their pool's pipes; a case's record is written and counted under one
    lock, and none is written once ``stop`` is set (Ctrl-C), so an interrupted case is never recorded
    as the crash its killed ranks would look like. Pools stay warm from one case to the next: a case
    costs no process start, import or process-group set-up (``harness.ranks.pool``).
    """

    def __init__(self, writer: Any, progress: Progress, deadline: float | None, case_timeout_s: float,
                 *, repeat: int = 1, repeat_failures: int = 0, open_pool: Callable[[Lane], "Pool"] | None = None) -> None:
        if repeat < 1 or repeat_failures < 0:
            raise ValueError(f"CaseRunner: repeat={repeat} must be >= 1 and repeat_failures={repeat_failures} >= 0 "
                             "(--repeat, --repeat-failures)")
        self.writer = writer
        self.progress = progress
        #: ``time.monotonic()`` after which no case is launched; None: no budget.
        self.deadline = deadline
        self.case_timeout_s = case_timeout_s
        #: runs of every case, and extra runs of a case whose runs did not all pass.
        self.repeat = repeat
        self.repeat_failures = repeat_failures
        #: lane -> the pool that runs its cases, entered and left by the lane's thread; None: a ``RankPool``
        #: on the lane's ranks (under torchrun, the world: ``harness.ranks.torchrun_world``).
        self.open_pool = open_pool or self._rank_pool
        self.stop = threading.Event()
        #: cases launched and recorded by this runner.
        self.recorded = 0
        #: seconds spent writing records (each durable before the next: ``ResultWriter.append``'s fsync).
        self.records_s = 0.0
        #: seconds the pools took to close after their lanes' last cases: per ``run`` the slowest lane's
        #: (the lanes close side by side), summed over the world sizes (they run one after the other).
        self.close_s = 0.0
        self._run_close_s = 0.0
        #: one line per pool that could not (re)start or whose thread failed.
        self.lane_errors: list[str] = []
        #: the results file could not be written: every lane stops and ``run`` raises this.
        self.write_error: OSError | None = None
        self._lock = threading.Lock()
        #: the pools of the ``run`` under way and the events its lanes set when over, for ``interrupt``.
        self._pools: list[Pool] = []
        self._done: list[threading.Event] = []

    def over_budget(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def run_all(self, lanes: Mapping[int, Sequence[Lane]], cases: Sequence[CaseConfig],
                budget_s: float | None = None) -> tuple[list[tuple[CaseConfig, str]], bool]:
        """Every world size's cases on its lanes, one world size after the other (each plan fills the
        GPUs on its own). Returns the cases not launched with why, and whether some pool failed."""
        not_run: list[tuple[CaseConfig, str]] = []
        pools_failed = False
        for ws, group in lanes.items():
            left = self.run(group, [c for c in cases if c.world_size == ws])
            if not left:
                continue
            if self.over_budget():
                why = f"time budget of {budget_s:g} s spent" if budget_s is not None else "time budget spent"
            else:
                pools_failed = True
                why = "; ".join(self.lane_errors) or "no pool took it"
            not_run += [(c, why) for c in left]
        return not_run, pools_failed

    def run(self, lanes: Sequence[Lane], cases: Sequence[CaseConfig]) -> list[CaseConfig]:
        """Run ``cases`` on ``lanes`` (``lanes_to_start`` of them); returns the cases that were not launched."""
        lanes = lanes_to_start(lanes, cases)
        # No pool starts once the budget is spent: a world size's pools (NCCL set-up on a loaded node takes
        # seconds each) would start only to find the deadline passed and close again, past the budget.
        if not lanes or self.over_budget():
            return list(cases)
        # Handed out so that each pool's reference cache is hit: grouped by what the references train, or
        # under a time budget in the (sampled) order with a lookahead (``harness.run.case_queue``).
        queue = CaseQueue(cases, trained_fields, grouped=self.deadline is None, window=LOOKAHEAD_PER_LANE * len(lanes))
        # Each lane sets its own event when it is over: a Thread.join that Ctrl-C interrupts can mark a
        # running thread stopped (CPython 3.11), and ``interrupt`` must still wait for the pools to close.
        self._done = [threading.Event() for _ in lanes]
        self._run_close_s = 0.0
        threads = [threading.Thread(target=self._lane, args=(i, lane, queue, done), daemon=True, name=f"harness-lane{i}")
                   for i, (lane, done) in enumerate(zip(lanes, self._done))]
        for thread in threads:
            thread.start()
        for done in self._done:
            while not done.wait(0.2):  # a timed wait lets Ctrl-C reach the main thread
                pass
        self.close_s += self._run_close_s
        if self.write_error is not None:
            raise self.write_error
        return queue.remaining()

    def interrupt(self, wait_s: float = 30.0) -> None:
        """Stop every lane: no case is launched or recorded any more, the running ones end with their
        ranks killed, and each lane closes its pool (ranks gone, files removed) within ``wait_s``."""
        with self._lock:
            self.stop.set()
            pools = list(self._pools)
        for pool in pools:
            pool.kill_ranks()
        deadline = time.monotonic() + wait_s
        for done in self._done:
            done.wait(max(deadline - time.monotonic(), 0))

    def _lane(self, index: int, lane: Lane, queue: CaseQueue, done: threading.Event) -> None:
        try:
            self._run_lane(index, lane, queue)
        finally:
            done.set()

    def _rank_pool(self, lane: Lane) -> "RankPool":
        from harness.ranks.pool import PoolConfig, RankPool

        return RankPool(PoolConfig(world_size=lane.world_size, backend=lane.backend, devices=lane.devices,  # type: ignore[arg-type]
                                   case_timeout_s=self.case_timeout_s))

    def _run_lane(self, index: int, lane: Lane, queue: CaseQueue) -> None:
        from harness.ranks.pool import PoolStartError

        case: CaseConfig | None = None
        try:
            with self._timing_close(self.open_pool(lane)) as pool:
                with self._lock:
                    if self.stop.is_set():
                        return
                    self._pools.append(pool)
                while True:
                    with self._lock:
                        if self.stop.is_set() or self.over_budget():
                            return
                        case = queue.take(index)
                        if case is None:
                            return
                    record = run_repeated(pool, case, self.repeat, self.repeat_failures)
                    with self._lock:
                        if self.stop.is_set():
                            return
                        try:
                            t0 = time.perf_counter()
                            self.writer.append(record)
                            self.records_s += time.perf_counter() - t0
                        except OSError as exc:
                            # Losing results silently is worse than stopping: every lane stops.
                            self.write_error = exc
                            self.stop.set()
                            return
                        self.progress.update(record, case.full_id)
                        self.recorded += 1
                        case = None
        except PoolStartError as exc:
            self._lane_failed(index, lane, case, queue, f"pool did not start: {str(exc).splitlines()[0]}")
        except Exception as exc:  # noqa: BLE001 - a lane's failure must leave its case visible as not run
            self._lane_failed(index, lane, case, queue, f"{type(exc).__name__}: {exc}")

    @contextlib.contextmanager
    def _timing_close(self, pool: "Pool") -> Iterator[Any]:
        """``pool`` entered and left, the time its leaving takes (its ranks' exit: on a loaded GPU node,
        seconds of CUDA and NCCL teardown) kept in ``close_s``, which a time budget's end includes."""
        closing_since: float | None = None
        try:
            with pool as entered:
                try:
                    yield entered
                finally:
                    closing_since = time.monotonic()
        finally:
            if closing_since is not None:
                with self._lock:
                    self._run_close_s = max(self._run_close_s, time.monotonic() - closing_since)

    def _lane_failed(self, index: int, lane: Lane, case: CaseConfig | None, queue: CaseQueue, why: str) -> None:
        with self._lock:
            if case is not None:
                queue.put_back(index, case)  # not recorded: another lane may take it, or it is listed as not run
            where = f"GPUs {list(lane.devices)}" if lane.devices else "CPU"
            self.lane_errors.append(f"world size {lane.world_size} on {where}: {why}")
