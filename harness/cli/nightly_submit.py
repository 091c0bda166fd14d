"""``python -m harness nightly --submit local|slurm --parts N``: the parts of a night as one job array.

The scheduler is submitit's (``submitit.AutoExecutor``: Slurm, or its local executor on this machine); we
build none. Each array task runs the nightly of one part in-process (``nightly --part K/N`` into
``OUT/shards/K-of-N``, ``harness.cli.nightly``), its index passed explicitly: the local executor sets no
Slurm variables, so ``--part auto`` would not find one. Once every task has ended, the merge
(``harness.cli.nightly_merge.merge_parts``) writes the night into ``OUT``, and its exit status is the
command's; raised to 1 when a task raised, was killed or could not run its cases (status 2), so that such a
night never reads as green even where the merge found every part's files.

A task that Slurm preempts or times out is requeued by submitit (``checkpoint``) and continues its part
with ``--resume``: the cases it recorded are kept.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.cli import night, nightly, nightly_merge
from harness.cli.nightly_config import NightlyConfig
from harness.cli.part_options import add_alias, part_dir
from harness.run.parts import PartSpec

__all__ = ["SUBMIT_DIR", "ArrayPlan", "PartTask", "SubmitOptions", "add_arguments", "main", "plan_array"]

#: submitit's folder (pickled tasks, logs, results) under the night's directory, by default.
SUBMIT_DIR = "submitit"

Cluster = Literal["local", "slurm"]


@dataclass(frozen=True)
class SubmitOptions:
    """Where and how the array runs: what the command line says of it, checked once."""

    #: submitit's executor: ``slurm``, or ``local`` (subprocesses on this machine, as CI tests it).
    cluster: Cluster
    #: parts of the night: tasks of the array.
    parts: int
    #: submitit's folder; None: ``OUT/submitit``.
    folder: Path | None = None
    #: Slurm partition (None: the cluster's default).
    partition: str | None = None
    #: minutes a task may run before the scheduler stops it (and submitit requeues it).
    time_min: int | None = None
    #: GPUs of one task (one node each); on ``local``, submitit shows every task the first G GPUs.
    gpus_per_task: int | None = None
    #: CPU cores of one task (its rank pools need several).
    cpus_per_task: int | None = None
    #: tasks running at once (Slurm's ``--array=...%P``); None: all.
    parallelism: int | None = None
    #: further ``#SBATCH`` options (``account=...``, ``qos=...``), as submitit's ``slurm_additional_parameters``.
    slurm_params: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.parts < 1:
            raise ValueError(f"--parts {self.parts}: must be at least 1")
        if self.cluster == "local":
            given = [name for name, value in (("--partition", self.partition), ("--slurm-param", self.slurm_params or None))
                     if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only for --submit slurm (the local executor has no partition)")

    def executor_parameters(self) -> dict[str, Any]:
        """``AutoExecutor.update_parameters`` keywords: generic ones, translated by submitit for each
        cluster, and ``slurm_`` ones, which the local executor ignores."""
        params: dict[str, Any] = {"name": "fsdp-parity-nightly", "nodes": 1, "tasks_per_node": 1,
                                  "slurm_array_parallelism": self.parallelism or self.parts}
        optional = {"timeout_min": self.time_min, "gpus_per_node": self.gpus_per_task,
                    "cpus_per_task": self.cpus_per_task, "slurm_partition": self.partition}
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.slurm_params:
            params["slurm_additional_parameters"] = dict(self.slurm_params)
        return params


class PartTask:
    """One array task: the nightly of part ``index`` of ``count`` with the command line's options.

    A plain callable object so that submitit pickles it; ``checkpoint`` is submitit's hook on preemption
    and timeout (``submitit.helpers.Checkpointable``'s protocol): the requeued task resumes its part."""

    def __init__(self, args: argparse.Namespace, index: int, count: int) -> None:
        self.args = copy.copy(args)
        # The part's own nightly: explicitly this part, nothing more to submit or merge.
        self.args.part = PartSpec(index, count)
        self.args.submit = None
        self.args.merge_parts = False
        self.args.out = Path(args.out).absolute()  # a task may start elsewhere (Slurm's working directory)

    @property
    def part(self) -> PartSpec:
        return self.args.part

    @property
    def out(self) -> Path:
        """Where this task's nightly writes."""
        return part_dir(self.args.out, self.part)

    def __call__(self) -> int:
        return nightly.main(self.args)

    def checkpoint(self) -> Any:
        import submitit

        again = PartTask(self.args, self.part.index, self.part.count)
        # The records written before the requeue are kept; a task stopped before it opened its results
        # file starts afresh (``--resume`` refuses a nightly that does not exist).
        again.args.resume = (self.out / night.RESULTS_NAME).exists()
        return submitit.helpers.DelayedSubmission(again)


@dataclass(frozen=True)
class ArrayPlan:
    """What one submission runs: a task per part, in part order, and submitit's folder."""

    tasks: tuple[PartTask, ...]
    folder: Path


def plan_array(args: argparse.Namespace, options: SubmitOptions) -> ArrayPlan:
    """The array of ``args``' night (``args.out``): task K-1 runs part K/N into ``OUT/shards/K-of-N``,
    submitit writes under ``options.folder`` or ``OUT/submitit``. Pure: nothing is submitted."""
    out = Path(args.out).absolute()
    tasks = tuple(PartTask(args, k, options.parts) for k in range(options.parts))
    folder = options.folder if options.folder is not None else out / SUBMIT_DIR
    return ArrayPlan(tasks, Path(folder).absolute())


# ---------------------------------------------------------------------------------------------------
# CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. account=myteam)")
    return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The nightly's options (``harness.cli.nightly.add_arguments``) and submitting's."""
    nightly.add_arguments(p)
    g = p.add_argument_group("submitting the parts as one job array (submitit)")
    g.add_argument("--submit", choices=("local", "slurm"), default=None,
                   help="submit the --parts as one job array (Slurm, or submitit's local executor), wait, "
                        "merge them into OUT and exit with the merge's status")
    g.add_argument("--parts", dest="parts", type=_positive_int, default=None, metavar="N", help="parts of the night (with --submit)")
    add_alias(g, "--shards", "parts", type=_positive_int, metavar="N")  # type: ignore[arg-type]
    g.add_argument("--partition", default=None, help="Slurm partition of the tasks")
    g.add_argument("--time-limit-min", type=_positive_int, default=None, metavar="MIN",
                   help="minutes per task; a task stopped at its limit is requeued and resumes its part")
    g.add_argument("--gpus-per-task", type=_positive_int, default=None, metavar="G", help="GPUs of each task (one node); locally, every task sees the first G GPUs")
    g.add_argument("--cpus-per-task", type=_positive_int, default=None, metavar="C", help="CPU cores of each task")
    g.add_argument("--array-parallelism", type=_positive_int, default=None, metavar="P",
                   help="tasks running at once (default: all)")
    g.add_argument("--slurm-param", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="a further sbatch option (account=..., qos=..., constraint=...); repeatable")
    g.add_argument("--submit-folder", type=Path, default=None, metavar="DIR",
                   help=f"submitit's folder: pickled tasks and the tasks' logs (default: OUT/{SUBMIT_DIR})")


#: the options that mean something only with ``--submit``, by argparse dest.
_SUBMIT_ONLY = {"parts": "--parts", "partition": "--partition", "time_limit_min": "--time-limit-min",
                "gpus_per_task": "--gpus-per-task", "cpus_per_task": "--cpus-per-task",
                "array_parallelism": "--array-parallelism", "slurm_param": "--slurm-param",
                "submit_folder": "--submit-folder"}


def submit_options(args: argparse.Namespace) -> SubmitOptions | None:
    """The submission ``args`` asks for; None without ``--submit``. Raises ``ValueError`` (one line,
    naming the option) for a combination that cannot work."""
    if args.submit is None:
        given = [flag for dest, flag in _SUBMIT_ONLY.items() if getattr(args, dest, None) not in (None, [])]
        if given:
            hint = " (one part of a night: --part K/N)" if "--parts" in given else ""
            raise ValueError(f"{', '.join(given)}: only with --submit local|slurm{hint}")
        return None
    if args.parts is None:
        raise ValueError(f"--submit {args.submit}: needs --parts N, the tasks of the array")
    if args.part is not None:
        raise ValueError(f"--submit: gives every task its part; drop --part {args.part}")
    if args.merge_parts:
        raise ValueError("--submit: merges once the tasks have ended; drop --merge-parts")
    return SubmitOptions(cluster=args.submit, parts=args.parts, folder=args.submit_folder,
                         partition=args.partition, time_min=args.time_limit_min, gpus_per_task=args.gpus_per_task,
                         cpus_per_task=args.cpus_per_task, parallelism=args.array_parallelism,
                         slurm_params=dict(args.slurm_param))


def _fail(message: str) -> int:
    print(f"harness nightly: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """The ``nightly`` command: ``--submit`` submits and merges, else ``harness.cli.nightly_merge.main``."""
    try:
        options = submit_options(args)
    except ValueError as exc:
        return _fail(str(exc))
    if options is None:
        return nightly_merge.main(args)
    config = nightly.config_from_args(args)  # every nightly option checked here, before anything is submitted
    if config is None:
        return 2
    return submit(args, options, config)


def submit(args: argparse.Namespace, options: SubmitOptions, config: NightlyConfig) -> int:
    """Submit ``plan_array``'s tasks through submitit, wait for them, merge; returns the exit status."""
    try:
        import submitit
    except ImportError:
        return _fail(f"--submit {options.cluster}: needs submitit (pip install submitit)")
    plan = plan_array(args, options)
    executor = submitit.AutoExecutor(folder=plan.folder / "%j", cluster=options.cluster)
    executor.update_parameters(**options.executor_parameters())
    try:
        # One array (``batch``), a task object per part rather than ``map_array`` over one function:
        # submitit asks the submitted callable itself for ``checkpoint`` when it requeues a task.
        with executor.batch():
            jobs = [executor.submit(task) for task in plan.tasks]
    except Exception as exc:  # submitit's errors are its own classes and sbatch's text
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        return _fail(f"--submit {options.cluster}: submitting the array failed: {last}")
    print(f"harness nightly: {len(jobs)} part(s) submitted ({options.cluster}, job {jobs[0].job_id.split('_')[0]}); "
          f"logs in {plan.folder}", file=sys.stderr)
    try:
        troubles = _wait(jobs, plan.tasks)
    except KeyboardInterrupt:
        # A Slurm array outlives this process; its night is merged later (local tasks may stop with it).
        print(f"\ninterrupted while waiting for the array; once its tasks have ended: python -m harness nightly "
              f"--out {args.out} --merge-parts", file=sys.stderr)
        return 130
    print(f"harness nightly: merging the parts into {args.out}", file=sys.stderr)
    code = nightly_merge.merge_parts(config)
    if troubles and code == 0:
        print(f"harness nightly: exit 1: {'; '.join(troubles)}", file=sys.stderr)
        return 1
    return code


def _wait(jobs: Sequence[Any], tasks: Sequence[PartTask]) -> list[str]:
    """Wait for every task; what went wrong with each (raised, killed, or exit 2), said as it ends."""
    troubles = []
    for job, task in zip(jobs, tasks):
        label = f"part {task.part.index + 1}/{task.part.count} (job {job.job_id})"
        try:
            status = job.result()
        except Exception as exc:  # the task raised or was killed; submitit's error holds its log's tail
            last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            troubles.append(f"{label} failed: {last[0]} (log: {job.paths.stderr})")
        else:
            print(f"harness nightly: {label} ended with status {status} -> {task.out}", file=sys.stderr)
            if status not in (0, 1):  # 1 is failing cases, which the merge reports itself
                troubles.append(f"{label} exited with status {status} (log: {job.paths.stderr})")
    for trouble in troubles:
        print(f"harness nightly: {trouble}", file=sys.stderr)
    return troubles
