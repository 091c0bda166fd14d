"""``python -m harness run|list|models``: run parity cases and record them, list them, describe the zoo.

``run`` selects cases from a matrix generator (``harness.selection.matrix``), runs them on persistent rank pools
(several side by side on each group of GPUs, ``harness.ranks.placement.plan_lanes``, through
``harness.run.session.RunSession``) and appends one record per case to a JSON Lines file through the
collector; a progress bar shows the ETA, the summary the cases per second. Started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set), the
ranks are torchrun's own: rank 0 runs the cases through a ``RunSession`` on one lane whose pool is the
world (``harness.ranks.torchrun_world``: the other ranks serve it) and records, and the watchdog is
``harness.ranks.torchrun_watch`` (a lost node is a crash naming it; the run then ends). ``--part K/N`` runs
(or lists) the K-th of N disjoint parts of the selection (``harness.cli.part_options``).

Exit status of ``run``: 0 when every case of the results file (the resumed ones included) passed or
is unsupported, 1 when some failed, errored, timed out or crashed, 2 when an option cannot work
(checked before any case runs), the ranks could not start or the results file could not be written,
130 on Ctrl-C, 143 on SIGTERM and 129 on SIGHUP (rerun with ``--resume``: the line printed is shell-quoted).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cases.case import CaseConfig
from harness.cli.options import (
    add_case_timeout, add_execution, add_placement, add_selection, non_empty_path, selection_options,
)
from harness.cli.part_options import add_part_options
from harness.cli.signals import interrupt_exit_status, resume_command, terminate_as_interrupt
from harness.ranks.mps import MpsError
from harness.run.options import SelectionOptions
from harness.run.runner import (Selection, SelectionError, exit_status, file_counts, lanes_to_start, summary,
                                 under_torchrun)
from harness.run.session import Part, RunSession, plan_local_lanes, select_part
from harness.run.parts import PartError
from harness.run.stored_selection import (
    StoredSelection,
    StoredSelectionError,
    contradictions,
    legacy_warning,
    option_key,
    read_selection,
    selection_from_options,
    selection_options as stored_options,
    selection_path,
)

if TYPE_CHECKING:
    from harness.collect.collector import ResultWriteError, ResultWriter
    from harness.ranks.placement import Lane
    from harness.ranks.torchrun_world import TorchrunWorld


# ---------------------------------------------------------------------------------------------------
# run on the pool


def _default_out() -> Path:
    return Path("results") / f"run-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


def report_command(out: Path) -> str:
    """The command that builds the report of results file ``out`` (printed after every run)."""
    report_dir = out.with_name(f"{out.stem}-report")
    return f"python3 -m reports build {shlex.quote(str(out))} --out {shlex.quote(str(report_dir))}"


def _open_results(out: Path, info: Any, resume: bool) -> "ResultWriter | str":
    """The results writer for ``--out``, or the one line refusing it (under torchrun too)."""
    from harness.collect.collector import ResultsLocked, ResultWriter

    if resume and not out.exists():  # a typo must not start a fresh run
        return f"--resume: {out} does not exist, so there is nothing to continue; check the path, or drop --resume to start a new run"
    try:
        return ResultWriter(out, info, resume=resume)
    except FileExistsError:
        return f"--out {out} already holds results; add --resume to continue it, or choose a new --out"
    except ResultsLocked as exc:
        return f"--out: {exc}"
    except (ValueError, OSError) as exc:
        return f"--out {out}: {exc}"


def write_error_text(exc: "ResultWriteError", out: Path) -> str:
    """The one line of a results file that could not be written: what to do next."""
    if not exc.records_kept:
        return f"--out: {exc}"
    return (f"--out: {exc}; every record written before it is kept: "
            f"free space and continue with {resume_command('--out', out, '--resume')}")


def _refuse(message: str) -> int:
    print(f"harness run: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    if under_torchrun():
        return _run_torchrun(args)
    from harness.collect.collector import ResultWriteError, out_path_problem, run_info
    from harness.ranks.placement import PlacementError

    options = selection_options(args)
    out = Path(args.out) if args.out else _default_out()
    problem = out_path_problem(out)
    if problem:
        return _refuse(f"--out: {problem}")
    resume = args.resume or args.rerun_failed
    world_sizes = list(options.world_sizes or [2])
    try:
        selection, world_sizes, stored = _resumed(args, options, out, world_sizes)
    except SelectionError as exc:
        return _refuse(str(exc))
    try:
        part = _part(args, selection, world_sizes, stored)
    except PartError as exc:
        return _refuse(str(exc))
    try:
        lanes, skipped, crowded = plan_local_lanes(list(part.world_sizes), options.backend, options.device,
                                                   args.pools_per_gpu, list(part.world_sizes))
    except PlacementError as exc:
        return _refuse(str(exc))
    if crowded:
        print(f"harness run: warning: {crowded}", file=sys.stderr)
    for ws, why in skipped.items():
        print(f"harness run: world size {ws} skipped: {why}", file=sys.stderr)
    writer = _open_results(out, run_info([lane for group in lanes.values() for lane in group]), resume)
    if isinstance(writer, str):
        return _refuse(writer)
    session = RunSession(writer, lanes, case_timeout_s=options.case_timeout_s, repeat=args.repeat,
                         repeat_failures=args.repeat_failures, show_progress=not args.no_progress, mps=args.mps)
    with session, terminate_as_interrupt():
        for bad in writer.bad_lines:
            print(f"warning: unreadable line {bad}", file=sys.stderr)
        if session.latest and part.stored is None:
            print(legacy_warning(out, session.latest.values()), file=sys.stderr)
        part.store(out)
        rerun = session.reruns(args.rerun_failed)
        todo = session.todo(part.cases, args.rerun_failed)
        if session.latest:
            print(f"resuming {out}: {len([c for c in part.cases if c.full_id in session.latest and c.full_id not in rerun])} of "
                  f"{len(part.cases)} cases already recorded"
                  + (f", {len([c for c in part.cases if c.full_id in rerun])} not passing to rerun" if args.rerun_failed else ""),
                  file=sys.stderr)
        of = f" ({part.describe()})" if part.cut else ""
        print(f"harness run: {len(todo)} cases{of} on {lane_text(lanes, todo)}", file=sys.stderr)
        try:
            session.run(todo)
        except ResultWriteError as exc:
            return _refuse(write_error_text(exc, out))
        except MpsError as exc:
            return _refuse(str(exc))
        except KeyboardInterrupt as exc:
            print(f"\ninterrupted; the ranks are stopped. Continue with: {resume_command('--out', out, '--resume')}", file=sys.stderr)
            return interrupt_exit_status(exc)
    if session.mps.wanted:
        print(f"harness run: {session.mps.describe()}", file=sys.stderr)
    if session.pools_failed:
        hint = "; the pools ran under CUDA MPS: --mps off runs them without it" if session.mps.active else ""
        return _refuse(f"{len(session.not_run)} case(s) not run: {session.not_run[0][1]}{hint}")
    assert session.progress is not None
    print(summary(session.progress.counts, out, session.wall_s, session.progress.unsupported))
    counts = file_counts(session.latest)
    if resume:
        held = ", ".join(f"{v} {n}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"
        print(f"{out} holds {len(session.latest)} cases ({held}); the exit status covers them all"
              + ("" if args.rerun_failed or not exit_status(counts) else "; --rerun-failed reruns the ones not passing"))
    if writer.bad_lines:
        print(f"warning: {len(writer.bad_lines)} unreadable line(s) in {out} (listed above)", file=sys.stderr)
    print(f"report: {report_command(out)}")
    return exit_status(counts)


def _resumed(args: argparse.Namespace, options: SelectionOptions, out: Path | None,
             world_sizes: list[int]) -> tuple[Selection, list[int], StoredSelection | None]:
    """The selection to run: when resuming ``out``, the one stored beside it. Raises ``SelectionError``
    naming every option given again with another value than the stored one."""
    selection = options.selection()
    try:
        stored = read_selection(out) if out is not None and (args.resume or args.rerun_failed) else None
    except StoredSelectionError as exc:
        raise SelectionError(f"--resume: {exc}") from None
    if stored is None:
        return selection, world_sizes, None
    given = {option_key(d) for d in getattr(args, "given_options", ())}
    clash = contradictions(stored.options, stored_options(selection, world_sizes), given)
    if clash:
        raise SelectionError(f"--resume: {'; '.join(clash)} contradict the selection {out} was made with "
                             f"({selection_path(out).name}); drop them to continue it (a larger --limit too: "
                             "the limit picks the sample), or choose a new --out")
    selection, stored_sizes = selection_from_options(stored.options)
    return selection, stored_sizes, stored


def _part(args: argparse.Namespace, selection: Selection, world_sizes: list[int], stored: StoredSelection | None) -> Part:
    """This process's part of the selection (``--part``; a resumed file's own). Raises ``PartError``, and
    ``SelectionError`` for options naming no cases (the caller's parser says it)."""
    return select_part(selection, world_sizes, part=args.part, part_costs=args.part_costs, stored=stored)


def lane_text(lanes: dict[int, list[Any]], cases: Sequence[CaseConfig]) -> str:
    """``4 pool(s) of 2 ranks (nccl on GPUs [0, 1] (one per rank))``, per world size: the pools that will
    start for the world size's ``cases`` (``harness.run.runner.lanes_to_start``)."""
    parts = []
    for ws, group in lanes.items():
        started = lanes_to_start(group, [c for c in cases if c.world_size == ws])
        if not started:
            continue
        where = started[0].describe({d for lane in started for d in (lane.devices or ())})
        parts.append(f"{len(started)} pool(s) of {ws} ranks ({where})")
    return "; ".join(parts) or "no pool (nothing to run)"


# ---------------------------------------------------------------------------------------------------
# run under torchrun


def _run_torchrun(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from harness.collect.collector import run_info
    from harness.ranks.rank import RankContext
    from harness.ranks.rank_process import die_with_parent
    from harness.ranks.torchrun_watch import TorchrunWatch, site_of_this_rank
    from harness.ranks.torchrun_world import TorchrunWorld

    die_with_parent()  # torchrun leaves the workers of a SIGKILLed agent running: not ours
    options = selection_options(args)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    from harness.ranks.placement import PlacementError, n_gpus, place

    # torchrun places the ranks of this node: the rule is the pool's, over the local ranks.
    try:
        lane = place(local_ws, n_gpus(), options.backend, options.device)
    except PlacementError as exc:
        return _refuse(str(exc))
    backend = lane.backend
    if lane.devices is not None:
        device = torch.device("cuda", lane.devices[local_rank])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    init: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=1), **init)
    ctx = RankContext(rank, ws, local_rank, local_ws, backend, device)
    if options.world_sizes and list(options.world_sizes) != [ws]:
        print(f"harness run: --world-size {list(options.world_sizes)} ignored under torchrun (WORLD_SIZE={ws})",
              file=sys.stderr)
    out = Path(args.out) if args.out else _default_out()
    # The stored selection, at torchrun's world size (every rank reads it: rank 0 alone writes the file).
    # Every rank cuts the same part: the partition is a function of the selection, N and the costs.
    selection, _, stored = _resumed(args, options, out, [ws])
    try:
        part = _part(args, selection, [ws], stored)
    except PartError as exc:
        return _refuse(str(exc))

    # Where every rank lives, so a lost node is named (torchrun's GROUP_RANK, the host).
    sites: list[Any] = [None] * ws
    dist.all_gather_object(sites, site_of_this_rank(rank))
    world = TorchrunWorld(ctx, TorchrunWatch(rank, sites, options.case_timeout_s))
    status = 0
    if rank == 0:
        with world:  # the other ranks get the stop when rank 0's cases are over (or refused)
            writer = _open_results(out, run_info([lane]), args.resume or args.rerun_failed)
            if isinstance(writer, str):
                status = _refuse(writer)
            else:
                part.store(out)
                status = _record_torchrun(args, options, world, writer, lane, part)
    else:
        world.serve()
    dist.barrier()
    world.watch.close()
    dist.destroy_process_group()
    # Leave without interpreter finalization: the watch's daemon thread may still be inside a store call
    # (its join is bounded), and finalizing under it once aborted a worker after a clean run
    # ("terminate called without an active exception"), which torchrun reports as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _record_torchrun(args: argparse.Namespace, options: SelectionOptions, world: "TorchrunWorld",
                     writer: "ResultWriter", lane: "Lane", part: Part) -> int:
    """Rank 0 under torchrun: the cases ``writer``'s file lacks (or reruns), through a ``RunSession`` on one
    lane whose pool is the world."""
    from harness.collect.collector import ResultWriteError
    from harness.compare.parity import record_from_outcome

    out = writer.path

    def record_lost(case: CaseConfig, outcome: Any) -> None:
        # The watch's thread, while the lane waits in the case: the run ends after this record.
        writer.append(record_from_outcome(case, outcome))
        writer.close()

    world.record_lost = record_lost
    # The case under way when Ctrl-C comes is not recorded, and nothing is left to wait for: the world is
    # the pool, and torchrun stops its ranks.
    # The lane is this node's share of the world; the cases are the world's size (torchrun's WORLD_SIZE).
    session = RunSession(writer, {ws: [lane] for ws in part.world_sizes}, case_timeout_s=options.case_timeout_s,
                         repeat=args.repeat, repeat_failures=args.repeat_failures, show_progress=not args.no_progress,
                         open_pool=lambda _: world, interrupt_wait_s=0)
    todo = session.todo(part.cases, args.rerun_failed)
    try:
        with session:
            session.run(todo)
    except ResultWriteError as exc:
        return _refuse(write_error_text(exc, out))
    assert session.runner is not None and session.progress is not None
    if session.runner.lane_errors:
        return _refuse(f"{len(todo) - session.recorded} case(s) not run: {'; '.join(session.runner.lane_errors)}")
    print(summary(session.progress.counts, out, session.wall_s, session.progress.unsupported))
    return exit_status(session.progress.counts)


# ---------------------------------------------------------------------------------------------------
# list, models, bench


def main_list(args: argparse.Namespace) -> int:
    options = selection_options(args)
    try:
        part = _part(args, options.selection(), list(options.world_sizes or [2]), None)
    except PartError as exc:
        print(f"harness list: {exc}", file=sys.stderr)
        return 2
    for case in part.cases:
        print(case.full_id)
    print(f"{len(part.cases)} cases" + (f" ({part.describe()})" if part.cut else ""), file=sys.stderr)
    return 0


def main_models(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from harness.cases.models import MODELS, build_model, zoo_names

    rows = []
    for name in zoo_names():
        spec, model = MODELS[name], build_model(name)
        rows.append((name, sum(p.numel() for p in model.parameters()), len(model.wrap_units()), spec.description))
    print(tabulate(rows, headers=("model", "params", "units", "what")))
    return 0


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_selection(p)
    add_part_options(p)
    p.add_argument("--out", type=non_empty_path, default=None, help="results file (JSON Lines); default results/run-<time>.jsonl")
    p.add_argument("--resume", action="store_true",
                   help="continue --out, skipping the cases it records; the exit status covers every case in the file")
    p.add_argument("--rerun-failed", action="store_true",
                   help="like --resume, but rerun the cases whose latest record is fail, error, timeout, crash or flaky "
                        "(the new record supersedes the old one in reports)")
    add_placement(p)
    add_case_timeout(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_execution(p)


def add_list_arguments(p: argparse.ArgumentParser) -> None:
    add_selection(p)
    add_part_options(p)
