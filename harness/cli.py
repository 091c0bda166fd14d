"""``python -m harness``: run parity cases, list them, or benchmark the pool.

``run`` selects cases from a matrix generator (``harness.matrix``), runs them on a persistent rank
pool (one per world size) and appends one record per case to a JSON Lines file through the
collector; a progress bar shows the ETA. Started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set), the
ranks are torchrun's own: every rank walks the same case list and rank 0 records.

Exit status of ``run``: 0 when every case passed or is unsupported, 1 when some failed, errored,
timed out or crashed, 2 when the ranks could not start, 130 on Ctrl-C (rerun with ``--resume``).
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.case import CaseConfig
from harness.records import CaseRecord

if TYPE_CHECKING:
    from harness.pool import RankPool

#: verdicts that make ``run`` exit with status 1.
BAD_VERDICTS = ("fail", "error", "timeout", "crash")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", default="smoke", choices=("smoke", "pairwise", "full"), help="case generator (harness.matrix)")
    p.add_argument("--engines", type=_csv, default=None, help="comma list: builtin,torch-fsdp,torch-fsdp2 (default: all)")
    p.add_argument("--references", type=_csv, default=None, help="comma list: ddp,local (default: the matrix's)")
    p.add_argument("--models", type=_csv, default=None, help="comma list of harness.models.MODELS (default: the matrix's)")
    p.add_argument("--world-size", type=lambda s: [int(x) for x in _csv(s)], default=None,
                   help="ranks per case, comma list for several pools (default 2; under torchrun its WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=None, help="training steps per case (default: CaseConfig's 5)")
    p.add_argument("--check-determinism", action="store_true", help="run each engine twice and require bitwise-equal results")
    p.add_argument("--filter", action="append", default=[], help="keep cases whose full id contains this (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="run at most this many cases")


class SelectionError(ValueError):
    """The selection options name no valid cases (an unknown engine, model ...)."""


def select_cases(args: argparse.Namespace, world_sizes: Sequence[int]) -> list[CaseConfig]:
    """The cases the selection options name, grouped by world size, in generator order."""
    try:
        return _select_cases(args, world_sizes)
    except ValueError as exc:
        raise SelectionError(str(exc)) from exc


def generate_cases(
    matrix: str,
    world_sizes: Sequence[int],
    references: Sequence[str] | None = None,
    axes: Mapping[str, Sequence[Any]] | None = None,
    **fixed: Any,
) -> list[CaseConfig]:
    """The cases of generator ``matrix`` (``harness.matrix.generate`` over ``axes``, keywords pinned) for
    every world size and reference, each pinned in turn, without duplicates, in generator order.

    Shared by ``harness run`` and the generated pytest suites (``harness.pytest_cases``). References
    are pinned in turn because a generator that keeps an axis at its first value (smoke) would
    otherwise never show the second one; None keeps the matrix's reference axis.
    """
    from harness.matrix import generate

    found: dict[str, CaseConfig] = {}
    for ws in world_sizes:
        for reference in references or [None]:
            pinned = {**fixed, "world_size": ws, **({"reference": reference} if reference else {})}
            for case in generate(matrix, axes=axes, **pinned):  # type: ignore[arg-type]
                found.setdefault(case.full_id, case)
    return list(found.values())


def run_case(pool: "RankPool", case: CaseConfig) -> CaseRecord:
    """Run one case on a started (or lazily starting) pool and decide its all-rank record."""
    from harness.parity import record_from_outcome, run_case_on_rank

    return record_from_outcome(case, pool.run(run_case_on_rank, case))


def _select_cases(args: argparse.Namespace, world_sizes: Sequence[int]) -> list[CaseConfig]:
    from harness.models import MODELS

    unknown = [m for m in args.models or [] if m not in MODELS]
    if unknown:
        raise ValueError(f"--models: {unknown} not in harness.models.MODELS; choose from {sorted(MODELS)}")

    axes: dict[str, list[Any]] = {}
    if args.engines:
        axes["engine"] = args.engines
    if args.models:
        axes["model"] = args.models
    fixed: dict[str, Any] = {}
    if args.steps is not None:
        fixed["steps"] = args.steps
    if args.check_determinism:
        fixed["check_determinism"] = True
    cases = generate_cases(args.matrix, world_sizes, args.references, axes=axes or None, **fixed)
    if args.filter:
        cases = [c for c in cases if any(f in c.full_id for f in args.filter)]
    if args.limit is not None:
        cases = cases[: args.limit]
    return cases


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _default_out() -> Path:
    return Path("results") / f"run-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


class Progress:
    """The progress bar and the per-verdict counts; problems are printed above the bar as they come."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.counts: collections.Counter[str] = collections.Counter()
        self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, disable=not enabled, file=sys.stderr)

    def update(self, record: CaseRecord, full_id: str) -> None:
        self.counts[record.verdict] += 1
        if record.verdict in BAD_VERDICTS:
            self.bar.write(f"{record.verdict:8s} {full_id}: {record.reason}", file=sys.stderr)
        self.bar.set_postfix(dict(self.counts), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _summary(counts: collections.Counter[str], out: Path, elapsed: float) -> str:
    from tabulate import tabulate

    rows = [(verdict, n) for verdict, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return f"{tabulate(rows, headers=('verdict', 'cases'))}\n{sum(counts.values())} cases in {elapsed:.1f} s -> {out}"


def _exit_status(counts: collections.Counter[str]) -> int:
    return 1 if any(counts[v] for v in BAD_VERDICTS) else 0


# ---------------------------------------------------------------------------------------------------
# run on the pool


def cmd_run(args: argparse.Namespace) -> int:
    if _under_torchrun():
        return _run_torchrun(args)
    import torch

    from harness.collector import ResultWriter, run_info
    from harness.pool import PoolConfig, PoolStartError, RankPool, assign_devices, default_backend, xdist_worker

    world_sizes = args.world_size or [2]
    cases = select_cases(args, world_sizes)
    out = Path(args.out) if args.out else _default_out()
    worker, workers = xdist_worker()
    backends = {ws: (args.backend if args.backend != "auto" else default_backend(ws)) for ws in world_sizes}
    info = run_info(",".join(sorted(set(backends.values()))))
    start = time.monotonic()
    try:
        writer = ResultWriter(out, info, resume=args.resume)
    except FileExistsError as exc:
        print(f"harness run: {exc}", file=sys.stderr)
        return 2
    with writer:
        done = writer.recorded_ids()
        todo = [c for c in cases if c.full_id not in done]
        if done:
            print(f"resuming {out}: {len(cases) - len(todo)} of {len(cases)} cases already recorded", file=sys.stderr)
        progress = Progress(len(todo), enabled=not args.no_progress)
        try:
            for ws in world_sizes:
                group = [c for c in todo if c.world_size == ws]
                if not group:
                    continue
                backend = backends[ws]
                devices = assign_devices(ws, torch.cuda.device_count(), worker, workers) if backend == "nccl" else None
                config = PoolConfig(world_size=ws, backend=backend, devices=devices, case_timeout_s=args.timeout)
                with RankPool(config) as pool:
                    for case in group:
                        record = run_case(pool, case)
                        writer.append(record)
                        progress.update(record, case.full_id)
        except PoolStartError as exc:
            progress.close()
            print(f"harness run: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            progress.close()
            print(f"\ninterrupted; the ranks are stopped. Continue with: --out {out} --resume", file=sys.stderr)
            return 130
        progress.close()
    print(_summary(progress.counts, out, time.monotonic() - start))
    return _exit_status(progress.counts)


# ---------------------------------------------------------------------------------------------------
# run under torchrun


class _TorchrunWatchdog:
    """The per-case time limit under torchrun: no parent can kill a hung rank, so on expiry every rank
    dumps its stacks to stderr, rank 0 records the case as ``timeout`` with its own stack, and the
    process exits (torchrun then stops the others; ``--resume`` continues after the case)."""

    def __init__(self, rank: int, timeout_s: float, on_timeout: Any) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._timer: threading.Timer | None = None
        self._main = threading.main_thread().ident

    def __enter__(self) -> "_TorchrunWatchdog":
        self._timer = threading.Timer(self.timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        frame = sys._current_frames().get(self._main)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        try:
            self.on_timeout(stack)
        finally:
            os._exit(124)


def _run_torchrun(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from harness.collector import ResultWriter, run_info
    from harness.parity import record_from_outcome, run_case_on_rank
    from harness.pool import PoolOutcome, RankContext, RankError

    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(hours=1))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
    ctx = RankContext(rank, ws, local_rank, local_ws, backend, device)
    if args.world_size and args.world_size != [ws]:
        print(f"harness run: --world-size {args.world_size} ignored under torchrun (WORLD_SIZE={ws})", file=sys.stderr)
    cases = select_cases(args, [ws])
    out = Path(args.out) if args.out else _default_out()

    writer = ResultWriter(out, run_info(backend), resume=args.resume) if rank == 0 else None
    # Every rank must walk the same list: rank 0 knows what the file already holds.
    shared: list[Any] = [sorted(writer.recorded_ids()) if writer else None, str(out)]
    dist.broadcast_object_list(shared, src=0)
    done = set(shared[0])
    todo = [c for c in cases if c.full_id not in done]
    progress = Progress(len(todo), enabled=rank == 0 and not args.no_progress)
    start = time.monotonic()
    try:
        for case in todo:
            def record_timeout(stack: str, case: CaseConfig = case) -> None:
                if writer is not None:
                    outcome = PoolOutcome(
                        "timeout", [None] * ws, f"no answer within {args.timeout:g} s under torchrun (run ended)",
                        stacks={0: stack}, wall_s=args.timeout,
                    )
                    writer.append(record_from_outcome(case, outcome))

            t0 = time.monotonic()
            with _TorchrunWatchdog(rank, args.timeout, record_timeout):
                try:
                    answer: tuple[str, Any] = ("ok", run_case_on_rank(ctx, case))
                except Exception as exc:  # every failure of a case is a result
                    answer = ("raised", RankError.from_exception(rank, exc))
                gathered: list[Any] = [None] * ws if rank == 0 else []
                dist.gather_object(answer, gathered if rank == 0 else None, dst=0)
            if writer is not None:
                errors = {r: v for r, (kind, v) in enumerate(gathered) if kind == "raised"}
                values = [v if kind == "ok" else None for kind, v in gathered]
                status = "error" if errors else "ok"
                reason = errors[min(errors)].line() if errors else ""
                outcome = PoolOutcome(status, values, reason, errors, wall_s=time.monotonic() - t0)
                record = record_from_outcome(case, outcome)
                writer.append(record)
                progress.update(record, case.full_id)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(_summary(progress.counts, out, time.monotonic() - start))
    return _exit_status(progress.counts) if rank == 0 else 0


# ---------------------------------------------------------------------------------------------------
# list, models, bench


def cmd_list(args: argparse.Namespace) -> int:
    cases = select_cases(args, args.world_size or [2])
    for case in cases:
        print(case.full_id)
    print(f"{len(cases)} cases", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from harness.models import MODELS, build_model

    rows = []
    for name, spec in MODELS.items():
        model = build_model(name)
        rows.append((name, sum(p.numel() for p in model.parameters()), len(model.wrap_units()), spec.description))
    print(tabulate(rows, headers=("model", "params", "units", "what")))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from harness.bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run parity cases and record them")
    _add_selection(run)
    run.add_argument("--out", default=None, help="results file (JSON Lines); default results/run-<time>.jsonl")
    run.add_argument("--resume", action="store_true", help="continue --out, skipping the cases it records")
    run.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                     help="auto: NCCL with one GPU per rank when there are enough, else gloo on CPU")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds per case before it is a timeout")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(fn=cmd_run)

    lst = sub.add_parser("list", help="print the full ids of the selected cases")
    _add_selection(lst)
    lst.set_defaults(fn=cmd_list)

    models = sub.add_parser("models", help="describe the model zoo")
    models.set_defaults(fn=cmd_models)

    from harness.bench import add_arguments

    bench = sub.add_parser("bench", help="per-case overhead: warm pool against spawning the ranks per case")
    add_arguments(bench)
    bench.set_defaults(fn=cmd_bench)

    from harness import nightly as nightly_module, perf as perf_module

    nightly = sub.add_parser("nightly", help="the nightly: full matrix, fuzz campaign, report and diff into one directory")
    _add_selection(nightly)
    nightly_module.add_arguments(nightly)
    nightly.set_defaults(fn=nightly_module.main)

    perf = sub.add_parser("perf", help="training-step benchmark: our engine against torch FSDP1 (and DDP, FSDP2)")
    perf_module.add_arguments(perf)
    perf.set_defaults(fn=perf_module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except SelectionError as exc:
        parser.error(str(exc))  # exits with status 2
        raise  # unreachable: parser.error exits
