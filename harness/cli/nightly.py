"""``python -m harness nightly --out reports/nightly/<date>``: the whole nightly in one command.

One straight line, every product written into the out directory as it is made:

1. the cases of the matrix (``full`` by default) on every local GPU (one pool per group of GPUs, the
   pools running side by side), or on 2 gloo ranks on CPU when there are no GPUs: ``results.jsonl``,
   one durable line per case (a killed nightly keeps every case it finished; ``--resume`` goes on);
2. the flat-parameter fuzz campaign (``suites.flat_param.campaign``, profile ``nightly``): ``fuzz.txt``,
   its output with examples per second;
3. the report (``reports.build``): ``matrix.md``, ``matrix.html``, ``results.csv``, heatmaps, ``summary.json``;
4. the diff against the previous nightly (the newest sibling directory whose name sorts before this
   one, or ``--previous``): ``diff.md``, ``diff.json``;
5. ``nightly.json``: counts per verdict, wall times, what was not run and why (rewritten after every
   phase, ``complete: false`` until the end); ``not_run.txt`` lists the cases a time budget left out.

Exit status: 0 when every case passed or is unsupported, the fuzz campaign passed and nothing regressed
against the previous nightly; 1 otherwise; 2 when the results file exists without ``--resume`` or the
ranks could not start, ``--out`` cannot be the nightly's directory, or the results file could not be
written; 130 on Ctrl-C and 143 on SIGTERM (rerun with ``--resume``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.case import CaseConfig
from harness.cli.options import add_selection, positive_float
from harness.cli.signals import interrupt_exit_status, terminate_as_interrupt
from harness.placement import BackendChoice, n_gpus, plan_lanes
from harness.runner import BAD_VERDICTS, CaseRunner, Progress, Selection, SelectionError, select_cases, under_torchrun

FuzzProfile = Literal["nightly", "ci", "dev", "none"]

RESULTS_NAME = "results.jsonl"
FUZZ_NAME = "fuzz.txt"
NIGHTLY_NAME = "nightly.json"
NOT_RUN_NAME = "not_run.txt"
DIFF_MD_NAME = "diff.md"
DIFF_JSON_NAME = "diff.json"
#: the repository holding this package; the fuzz campaign lives in its ``suites/``.
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class NightlyConfig:
    """What one nightly runs and where it writes."""

    #: the nightly's directory; every product is written here.
    out: Path
    #: case generator of ``harness.matrix``.
    matrix: Literal["full", "pairwise", "smoke"] = "full"
    #: engines to run (None: every engine of the matrix).
    engines: list[str] | None = None
    #: references to compare against (None: the matrix's).
    references: list[str] | None = None
    #: models of ``harness.models.MODELS`` (None: the matrix's).
    models: list[str] | None = None
    #: ranks per case (None: the matrix's world sizes that fit the local GPUs; 2 on CPU).
    world_sizes: list[int] | None = None
    #: training steps per case (None: ``CaseConfig``'s default).
    steps: int | None = None
    #: keep cases whose full id contains one of these.
    filters: list[str] = field(default_factory=list)
    #: at most this many cases (for trial runs and tests).
    limit: int | None = None
    #: Hypothesis profile of the fuzz campaign; ``none`` skips the campaign.
    fuzz_profile: FuzzProfile = "nightly"
    #: examples per fuzz property, overriding the profile's.
    fuzz_max_examples: int | None = None
    #: no case is launched once this many seconds have passed since the start (None: no budget).
    time_budget_s: float | None = None
    #: continue the nightly already in ``out`` (its recorded cases are skipped, a finished fuzz too).
    resume: bool = False
    #: the nightly (report directory or results file) to diff against; None: the newest earlier sibling.
    previous: Path | None = None
    #: ``auto``: NCCL with one GPU per rank when there are GPUs, else gloo on CPU.
    backend: BackendChoice = "auto"
    #: seconds per case before it is recorded as a timeout.
    case_timeout_s: float = 300.0
    #: show the progress bar.
    progress: bool = True

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.previous = Path(self.previous) if self.previous is not None else None
        if self.fuzz_max_examples is not None and self.fuzz_max_examples < 1:
            raise ValueError(f"NightlyConfig.fuzz_max_examples={self.fuzz_max_examples} must be at least 1")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise ValueError(f"NightlyConfig.time_budget_s={self.time_budget_s} must not be negative")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "NightlyConfig":
        return cls(
            out=args.out, matrix=args.matrix, engines=args.engines, references=args.references, models=args.models,
            world_sizes=args.world_size, steps=args.steps, filters=list(args.filter), limit=args.limit,
            fuzz_profile=args.fuzz_profile, fuzz_max_examples=args.fuzz_max_examples,
            time_budget_s=args.time_budget_s, resume=args.resume, previous=args.previous,
            backend=args.backend, case_timeout_s=args.timeout, progress=not args.no_progress,
        )

    def selection(self) -> Selection:
        """The cases this nightly selects (``harness.runner.select_cases``)."""
        return Selection(
            matrix=self.matrix, engines=self.engines, references=self.references, models=self.models,
            steps=self.steps, filters=self.filters, limit=self.limit,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        d["previous"] = str(self.previous) if self.previous is not None else None
        return d


# ---------------------------------------------------------------------------------------------------
# Pure logic






def _has_results(path: Path) -> bool:
    return any((path / name).exists() for name in ("results.csv", RESULTS_NAME))


def find_previous(out: Path) -> Path | None:
    """The newest earlier nightly: the sibling directory of ``out`` holding results whose name sorts
    last among those before ``out``'s name (date names, ``2026-11-21``, sort by date)."""
    out = Path(out)
    parent = out.parent
    if not parent.is_dir():
        return None
    earlier = [d for d in parent.iterdir() if d.is_dir() and d.name < out.name and _has_results(d)]
    return max(earlier, key=lambda d: d.name) if earlier else None


def baseline_source(previous: Path) -> Path:
    """What ``reports.diff`` should read of a previous nightly: its report directory when it has one
    (``results.csv``), else its raw results (a nightly killed before its report), else the path itself."""
    previous = Path(previous)
    if previous.is_dir() and not (previous / "results.csv").exists() and (previous / RESULTS_NAME).exists():
        return previous / RESULTS_NAME
    return previous


_TOTAL_ROW = re.compile(r"^\|\s*total\s*\|[^|]*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+|nan)\s*\|", re.MULTILINE)


def parse_fuzz_totals(text: str) -> dict[str, float] | None:
    """``{"examples", "seconds", "examples_per_s"}`` from the campaign's table, None when it has none."""
    match = None
    for match in _TOTAL_ROW.finditer(text):
        pass  # the last table is the campaign's
    if match is None:
        return None
    return {"examples": int(match[1]), "seconds": float(match[2]), "examples_per_s": float(match[3])}


def exit_status(verdicts: Mapping[str, int], fuzz_exit: int | None, regressions: int, pools_failed: bool) -> tuple[int, list[str]]:
    """The nightly's exit status and the reasons for it (see the module docstring)."""
    reasons: list[str] = []
    bad = {v: verdicts.get(v, 0) for v in BAD_VERDICTS if verdicts.get(v, 0)}
    if bad:
        reasons.append("cases " + ", ".join(f"{v}: {n}" for v, n in bad.items()))
    if fuzz_exit:
        reasons.append(f"fuzz campaign exited with status {fuzz_exit}")
    if regressions:
        reasons.append(f"{regressions} regression(s) against the previous nightly")
    if pools_failed:
        reasons.append("the ranks could not start; some cases were not run")
        return 2, reasons
    return (1 if reasons else 0), reasons


# ---------------------------------------------------------------------------------------------------
# Side effects


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    # Atomic: a nightly killed mid-write keeps the previous version, never half a file.
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}




@dataclass
class FuzzOutcome:
    """What the fuzz campaign did (``nightly.json``'s ``fuzz``)."""

    profile: str
    max_examples: int | None
    #: pytest's exit status; None when the campaign did not run.
    exit_code: int | None = None
    examples: int | None = None
    examples_per_s: float | None = None
    wall_s: float = 0.0
    #: why it did not run, when it did not.
    skipped: str | None = None


def run_fuzz(config: NightlyConfig, path: Path) -> FuzzOutcome:
    """Run the fuzz campaign in a child process, its output streamed into ``path``."""
    outcome = FuzzOutcome(config.fuzz_profile, config.fuzz_max_examples)
    campaign = REPO_ROOT / "suites" / "flat_param" / "campaign.py"
    if not campaign.exists():
        outcome.skipped = f"{campaign} not found: run the nightly from a checkout of the repository"
        return outcome
    cmd = [sys.executable, "-m", "suites.flat_param.campaign", "--profile", config.fuzz_profile]
    if config.fuzz_max_examples is not None:
        cmd += ["--max-examples", str(config.fuzz_max_examples)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd[1:])}\n")
        f.flush()
        outcome.exit_code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    outcome.wall_s = time.monotonic() - start
    totals = parse_fuzz_totals(path.read_text(encoding="utf-8", errors="replace"))
    if totals is not None:
        outcome.examples = int(totals["examples"])
        outcome.examples_per_s = totals["examples_per_s"]
    return outcome


def _matrix_world_sizes() -> list[int]:
    from harness.matrix import AXES

    return list(AXES["world_size"])


def out_dir_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the nightly's directory (checked before anything runs), or None."""
    from harness.collector import out_path_problem

    if out.exists() and not out.is_dir():
        return f"{out} is a file; the nightly writes a directory of products, name a directory"
    return out_path_problem(out / RESULTS_NAME)


def _warn_crowded(lanes: Mapping[int, Sequence[Any]]) -> None:
    from harness.placement import available_memory, cpu_footprint

    cpu = [ws for ws, group in lanes.items() if any(lane.backend == "gloo" for lane in group)]
    footprint = cpu_footprint(cpu, os.cpu_count() or 1, available_memory())
    if cpu and footprint.oversubscribed:
        print(f"harness nightly: warning: --world-size {max(cpu)} on CPU takes {footprint.describe()}; "
              "cases will be slow or run out of memory", file=sys.stderr)


def _cases_in(selection: Selection, world_size: int) -> int:
    try:
        return len(select_cases(selection, [world_size]))
    except SelectionError:
        return 0  # e.g. a --filter that matches only other world sizes


def nightly(config: NightlyConfig) -> int:
    """Run the nightly described by ``config``; returns its exit status."""
    with terminate_as_interrupt():
        try:
            return _nightly(config)
        except KeyboardInterrupt as exc:  # between phases; the phases say where they stopped
            print(f"\ninterrupted; rerun with: python -m harness nightly --out {config.out} --resume", file=sys.stderr)
            return interrupt_exit_status(exc)


def _nightly(config: NightlyConfig) -> int:
    from harness.collector import ResultsLocked, ResultWriter, run_info

    start = time.monotonic()
    out = config.out
    problem = out_dir_problem(out)
    if problem:
        print(f"harness nightly: --out: {problem}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / NIGHTLY_NAME
    earlier = _read_json(state_path) if config.resume else {}
    state: dict[str, Any] = {
        "out": str(out), "complete": False, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resumed": config.resume, "config": config.to_dict(),
    }

    def save() -> None:
        state["wall_s"] = round(time.monotonic() - start, 3)
        _write_json(state_path, state)

    # -- 1. cases ---------------------------------------------------------------------------------
    lanes, skipped_ws = plan_lanes(config.world_sizes, config.backend, n_gpus(), _matrix_world_sizes())
    if not lanes:
        print(f"harness nightly: no world size can run here (--backend {config.backend}): "
              f"{'; '.join(skipped_ws.values())}", file=sys.stderr)
        return 2
    _warn_crowded(lanes)
    selection = config.selection()
    cases = select_cases(selection, list(lanes))
    skipped = {ws: {"cases": _cases_in(selection, ws), "reason": why} for ws, why in skipped_ws.items()}
    backends = sorted({lane.backend for group in lanes.values() for lane in group}) or ["gloo"]
    try:
        writer = ResultWriter(out / RESULTS_NAME, run_info(",".join(backends)), resume=config.resume)
    except FileExistsError as exc:
        print(f"harness nightly: {exc}; or pass --resume to continue that nightly", file=sys.stderr)
        return 2
    except ResultsLocked as exc:
        print(f"harness nightly: --out: {exc}", file=sys.stderr)
        return 2
    cases_start = time.monotonic()
    deadline = start + config.time_budget_s if config.time_budget_s is not None else None
    with writer:
        done = writer.recorded_ids()
        todo = [c for c in cases if c.full_id not in done]
        if done:
            print(f"resuming {out}: {len(cases) - len(todo)} of {len(cases)} cases already recorded", file=sys.stderr)
        state["cases"] = {
            "selected": len(cases), "already_recorded": len(cases) - len(todo), "recorded": 0, "not_run": 0,
            "world_sizes": sorted(lanes), "backend": ",".join(backends),
            "lanes": [dataclasses.asdict(lane) for group in lanes.values() for lane in group],
            "world_sizes_skipped": skipped,
        }
        save()
        progress = Progress(len(todo), enabled=config.progress)
        runner = CaseRunner(writer, progress, deadline, config.case_timeout_s)
        not_run: list[tuple[CaseConfig, str]] = []
        pools_failed = False
        try:
            for ws, group in lanes.items():
                left = runner.run(group, [c for c in todo if c.world_size == ws])
                if not left:
                    continue
                if runner.over_budget():
                    why = f"time budget of {config.time_budget_s:g} s spent"
                else:
                    pools_failed = True
                    why = "; ".join(runner.lane_errors) or "no pool took it"
                not_run += [(c, why) for c in left]
        except KeyboardInterrupt as exc:
            runner.interrupt()
            progress.close()
            state["cases"].update(recorded=runner.recorded, interrupted=True)
            save()
            print(f"\ninterrupted; rerun with: python -m harness nightly --out {out} --resume", file=sys.stderr)
            return interrupt_exit_status(exc)
        except OSError as exc:  # the results file could not be written (runner.write_error)
            runner.interrupt()
            progress.close()
            state["cases"].update(recorded=runner.recorded, write_error=str(exc))
            save()
            print(f"harness nightly: {exc}; the records written before it are kept: free space and rerun "
                  f"with --out {out} --resume", file=sys.stderr)
            return 2
        progress.close()
    _write_not_run(out / NOT_RUN_NAME, not_run)
    state["cases"].update(
        recorded=runner.recorded, not_run=len(not_run),
        not_run_reasons=dict(collections.Counter(why for _, why in not_run)),
        lane_errors=runner.lane_errors, wall_s=round(time.monotonic() - cases_start, 3),
    )
    save()
    if not_run:
        print(f"harness nightly: {len(not_run)} case(s) not run, listed in {out / NOT_RUN_NAME}", file=sys.stderr)

    # -- 2. fuzz campaign -------------------------------------------------------------------------
    fuzz_path = out / FUZZ_NAME
    if config.fuzz_profile == "none":
        fuzz = FuzzOutcome("none", config.fuzz_max_examples, skipped="--fuzz-profile none")
        state["fuzz"] = dataclasses.asdict(fuzz)
    elif config.resume and earlier.get("fuzz", {}).get("exit_code") is not None and fuzz_path.exists():
        state["fuzz"] = {**earlier["fuzz"], "resumed_from_earlier_attempt": True}
    else:
        try:
            state["fuzz"] = dataclasses.asdict(run_fuzz(config, fuzz_path))
        except KeyboardInterrupt as exc:
            save()
            print(f"\ninterrupted; rerun with: python -m harness nightly --out {out} --resume", file=sys.stderr)
            return interrupt_exit_status(exc)
    save()

    # -- 3. report ----------------------------------------------------------------------------------
    import reports
    from reports import render

    t0 = time.monotonic()
    summary = reports.build([out / RESULTS_NAME], out)
    state["verdicts"] = dict(summary.verdicts)
    state["report"] = {"files": summary.files, "bad_lines": len(summary.bad_lines), "wall_s": round(time.monotonic() - t0, 3)}
    save()

    # -- 4. diff against the previous nightly -------------------------------------------------------
    previous = config.previous if config.previous is not None else find_previous(out)
    regressions = 0
    if previous is None:
        state["diff"] = {"previous": None, "note": f"no earlier nightly next to {out}"}
        for stale in (out / DIFF_MD_NAME, out / DIFF_JSON_NAME):
            stale.unlink(missing_ok=True)
    else:
        old = baseline_source(previous)
        t0 = time.monotonic()
        result = reports.diff(old, out / RESULTS_NAME)
        text = render.diff_markdown(result, str(old), str(out / RESULTS_NAME))
        (out / DIFF_MD_NAME).write_text(text, encoding="utf-8")
        _write_json(out / DIFF_JSON_NAME, result.to_dict())
        regressions = len(result.regressions)
        state["diff"] = {
            "previous": str(old), "exit_code": result.exit_code,
            "counts": result.to_dict()["counts"], "wall_s": round(time.monotonic() - t0, 3),
        }
    save()

    # -- 5. verdict ---------------------------------------------------------------------------------
    fuzz_exit = state["fuzz"].get("exit_code")
    code, reasons = exit_status(summary.verdicts, fuzz_exit, regressions, pools_failed)
    state.update(complete=True, exit_code=code, exit_reasons=reasons, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    save()
    print(_summary_text(state))
    return code


def _write_not_run(path: Path, not_run: Sequence[tuple[CaseConfig, str]]) -> None:
    if not not_run:
        path.unlink(missing_ok=True)  # a resumed nightly that ran them all
        return
    path.write_text("".join(f"{case.full_id}\t{why}\n" for case, why in not_run), encoding="utf-8")


def _summary_text(state: Mapping[str, Any]) -> str:
    from tabulate import tabulate

    cases, fuzz, diff = state["cases"], state["fuzz"], state["diff"]
    verdicts = [(v, n) for v, n in state["verdicts"].items() if n]
    lines = [tabulate(verdicts, headers=("verdict", "cases")) if verdicts else "no cases recorded"]
    lines.append(
        f"cases: {cases['selected']} selected, {cases['already_recorded']} already recorded, "
        f"{cases['recorded']} run now in {cases.get('wall_s', 0):.1f} s, {cases['not_run']} not run"
    )
    for ws, skip in cases["world_sizes_skipped"].items():
        lines.append(f"world size {ws}: {skip['cases']} cases not selected: {skip['reason']}")
    if fuzz.get("skipped"):
        lines.append(f"fuzz: skipped ({fuzz['skipped']})")
    else:
        rate = fuzz.get("examples_per_s")
        lines.append(f"fuzz: profile {fuzz['profile']}, exit {fuzz['exit_code']}, {fuzz.get('examples')} examples, "
                     f"{rate if rate is not None else '?'} examples/s, {fuzz.get('wall_s', 0):.1f} s")
    if diff.get("previous"):
        lines.append(f"diff against {diff['previous']}: " + ", ".join(f"{k} {n}" for k, n in diff["counts"].items()))
    else:
        lines.append(f"diff: {diff.get('note')}")
    verdict = "ok" if state["exit_code"] == 0 else "; ".join(state["exit_reasons"])
    lines.append(f"nightly {verdict} (exit {state['exit_code']}) in {state['wall_s']:.1f} s -> {state['out']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The selection options and the nightly's own."""
    add_selection(p)
    p.set_defaults(matrix="full")
    p.add_argument("--out", required=True, type=Path, help="the nightly's directory, e.g. reports/nightly/$(date +%%F)")
    p.add_argument("--resume", action="store_true", help="continue the nightly in --out (recorded cases and a finished fuzz are kept)")
    p.add_argument("--previous", type=Path, default=None,
                   help="nightly directory or results file to diff against (default: the newest earlier sibling of --out)")
    p.add_argument("--fuzz-profile", default="nightly", choices=("nightly", "ci", "dev", "none"),
                   help="Hypothesis profile of the fuzz campaign; none skips it")
    p.add_argument("--fuzz-max-examples", type=int, default=None, help="examples per fuzz property, overriding the profile")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="launch no case after this many seconds; the cases left are listed in not_run.txt")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: NCCL with one GPU per rank when there are GPUs, else 2 gloo ranks on CPU")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per case before it is a timeout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    if under_torchrun():
        print("harness nightly: start it without torchrun; it starts its own ranks (one pool per group of GPUs)",
              file=sys.stderr)
        return 2
    try:
        config = NightlyConfig.from_args(args)
    except ValueError as exc:
        print(f"harness nightly: {exc}", file=sys.stderr)
        return 2
    return nightly(config)
