"""``python -m harness nightly --out reports/nightly/<date>``: the whole nightly in one command.

Named phases in one straight line (``Nightly``: ``take_back_earlier_attempt``, ``plan_cases``, ``run_cases``,
``run_fuzz_campaign``, ``measure_perf``, ``build_report``, ``diff_previous``, ``conclude``), every product
written into the out directory as it is made; the cases run through ``harness.run.session.RunSession`` as
``harness run``'s do:

1. the cases of the matrix (``full`` by default) on every local GPU (several pools on each group of
   GPUs side by side, as many as ``harness.ranks.placement.pools_per_group`` allows or ``--pools-per-gpu``
   says), or on gloo ranks on CPU when there are no GPUs: ``results.jsonl``, one durable line per case
   (a killed nightly keeps every case it finished; ``--resume`` goes on). Determinism is checked on a
   sample (``determinism_sample``); ``--repeat``/``--repeat-failures`` rerun cases (``flaky`` verdicts);
   under ``--time-budget-s`` the cases run in sampled order (``harness.selection.sampling.sample_order``: every value
   of every axis first, then every pair);
2. the flat-parameter fuzz campaign (``harness.conformance.fuzz_campaign``, profile ``nightly``; under a time
   budget what is left of it, ``fuzz_budget``, after the cases at least ``FUZZ_SHARE``): ``fuzz.txt``;
   then the performance section (``harness.perf.perf_section``): step time and peak memory of our engine
   and torch FSDP1 on two GPUs, or a smoke check on CPU, kept under ``perf`` in ``nightly.json``;
3. the report (``reports.build``): ``matrix.md``, ``matrix.html``, ``results.csv``, heatmaps, ``summary.json``;
4. the diff against the previous nightly (the newest sibling directory holding a ``nightly.json`` whose
   name sorts before this one, or ``--previous``): ``diff.md``, ``diff.json``; and its performance ratios
   (a ratio to torch FSDP1 more than 5% worse on the same device is a regression): ``perf_diff``;
5. ``nightly.json``: counts per verdict, cases per second, wall times, where the cases' time went and how busy
   the host was (``harness.collect.breakdown``, ``harness.run.host_load``), nondeterministic engines per
   configuration, what was not run and why (rewritten after every phase; ``finished`` is set at the end,
   ``complete`` is true only when nothing was left out: every case, the fuzz campaign and the
   performance section that were asked for); ``not_run.txt`` lists the cases a time budget left out.

With ``--part K/N`` the nightly runs the K-th part of the selection (``harness.run.parts``) into
``OUT/shards/K-of-N``, the fuzz campaign and the performance section on part 1 only and no diff;
``--merge-parts`` (``harness.cli.nightly_merge``) makes the night of the parts in ``OUT``; ``--submit``
(``harness.cli.nightly_submit``) runs the parts as one submitit job array, then merges them.

Exit status: 0 when every case passed or is unsupported (a flaky case is bad), the fuzz campaign passed and nothing regressed
against the previous nightly; 1 otherwise; 2 when the results file exists without ``--resume`` or the
ranks could not start, ``--out`` cannot be the nightly's directory, or the results file could not be
written; 130 on Ctrl-C, 143 on SIGTERM and 129 on SIGHUP (rerun with the shell-quoted ``--resume`` line printed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.cases.case import CaseConfig
from harness.cases.records import not_run_text
from harness.cli.fuzz import FuzzOutcome, FuzzRun, cases_deadline, fuzz_alongside, fuzz_budget, report_reserve, run_fuzz
from harness.cli.night import (
    RESULTS_NAME,
    FUZZ_NAME,
    NIGHTLY_NAME,
    NOT_RUN_NAME,
    DIFF_MD_NAME,
    DIFF_JSON_NAME,
    ONE_PART,
    night_selection,
    find_previous,
    determinism_sample,
    determinism_summary,
    baseline_source,
    exit_status,
    partial_reasons,
    write_json,
    read_json,
)
from harness.cli.nightly_config import NightlyConfig, resumed_config
from harness.cli.options import (
    add_case_timeout, add_execution, add_placement, add_selection, budget_seconds, non_empty_path,
)
from harness.cli.part_options import add_alias, add_part_options, part_dir, resolve_part
from harness.cli.signals import interrupt_exit_status, terminate_as_interrupt
from harness.collect.breakdown import breakdown, breakdown_table
from harness.ranks.mps import MpsError, MpsState
from harness.ranks.placement import Lane, PlacementError, host_facts, n_gpus
from harness.run.host_load import HostSampler, host_text
from harness.run.runner import Selection, SelectionError, select_cases, under_torchrun
from harness.run.session import Part, RunSession, plan_local_lanes, select_part
from harness.run.parts import PartError
from harness.run.stored_selection import StoredSelection, StoredSelectionError, legacy_warning, read_selection
from harness.selection.sampling import sample_order

def _matrix_world_sizes() -> list[int]:
    from harness.selection.matrix import AXES

    return list(AXES["world_size"])


def out_dir_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the nightly's directory (checked before anything runs), or None."""
    from harness.collect.collector import out_path_problem

    if out.exists() and not out.is_dir():
        return f"{out} is a file; the nightly writes a directory of products, name a directory"
    return out_path_problem(out / RESULTS_NAME)


def _cases_in(selection: Selection, world_size: int) -> int:
    try:
        return len(select_cases(selection, [world_size]))
    except SelectionError:
        return 0  # e.g. a --filter that matches only other world sizes


def nightly(config: NightlyConfig) -> int:
    """Run the nightly described by ``config``; returns its exit status."""
    with terminate_as_interrupt():
        try:
            return Nightly(config).run()
        except KeyboardInterrupt as exc:  # between phases; the phases say where they stopped
            print(f"\ninterrupted; rerun with: {config.resume_line()}", file=sys.stderr)
            return interrupt_exit_status(exc)


class Nightly:
    """One nightly into its directory, in named phases (the module docstring's steps), each writing its
    products as it goes and ``nightly.json`` after it (``save``).

    ``run`` calls the phases in order; a phase returns None to go on, or the exit status to stop with.
    State between phases: ``config`` (a resumed one takes back the stored selection), ``out`` (a part's
    own directory), ``state`` (what ``nightly.json`` holds), ``earlier`` (the interrupted attempt's
    ``nightly.json``), ``lanes``, ``part`` (``harness.run.session.Part``), ``session``
    (``harness.run.session.RunSession``), ``alongside`` (a fuzz campaign running beside the cases),
    ``deadline`` (when the last case may start), ``report`` (the report's summary), ``previous`` and
    ``regressions``.
    """

    def __init__(self, config: NightlyConfig) -> None:
        self.config = config
        self.start = time.monotonic()
        self.out = part_dir(config.out, config.part)
        self.state: dict[str, Any] = {}
        self.earlier: dict[str, Any] = {}
        self.stored: StoredSelection | None = None
        self.lanes: dict[int, list[Lane]] = {}
        #: world size -> the cases it would hold and why it has no lane here.
        self.skipped: dict[int, dict[str, Any]] = {}
        self.part: Part | None = None
        self.session: RunSession | None = None
        self.alongside: FuzzRun | None = None
        self.deadline: float | None = None
        self.report: Any = None
        self.previous: Path | None = None
        self.regressions = 0

    @property
    def results(self) -> Path:
        return self.out / RESULTS_NAME

    @property
    def cut(self) -> dict[str, Any] | None:
        """This part's record (``Part.cut``); None for a whole night."""
        return self.part.cut if self.part is not None else None

    def save(self) -> None:
        self.state["wall_s"] = round(time.monotonic() - self.start, 3)
        write_json(self.out / NIGHTLY_NAME, self.state)

    def run(self) -> int:
        phases = (self.take_back_earlier_attempt, self.plan_cases, self.run_cases, self.run_fuzz_campaign,
                  self.measure_perf, self.build_report, self.diff_previous)
        for phase in phases:
            code = phase()
            if code is not None:
                return code
        return self.conclude()

    def _refuse(self, message: str) -> int:
        print(f"harness nightly: {message}", file=sys.stderr)
        return 2

    # -- before the cases -----------------------------------------------------------------------------

    def take_back_earlier_attempt(self) -> int | None:
        """Check ``--out``; resuming, take back the stored selection and the earlier attempt's options."""
        config = self.config
        problem = out_dir_problem(self.out)
        if problem:
            return self._refuse(f"--out: {problem}")
        if config.resume:
            self.earlier = read_json(self.out / NIGHTLY_NAME)
            try:
                if not self.results.exists():  # a typo must not start a fresh night
                    raise StoredSelectionError(f"{self.results} does not exist, so there is no nightly to continue; "
                                               "check --out, or drop --resume to start one")
                self.stored = read_selection(self.results)
                self.config = resumed_config(config, self.stored.options if self.stored else None,
                                             self.earlier.get("config") or {}, config.given_options)
            except ValueError as exc:  # SelectionError, StoredSelectionError
                return self._refuse(f"{'--resume: ' * isinstance(exc, StoredSelectionError)}{exc}")
        self.out.mkdir(parents=True, exist_ok=True)
        self.state = {"out": str(self.out), "complete": False, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "resumed": self.config.resume, "config": self.config.to_dict()}
        return None

    def plan_cases(self) -> int | None:
        """The lanes of this host and the part of the selection this nightly runs (determinism sampled)."""
        config = self.config
        try:
            self.lanes, skipped, crowded = plan_local_lanes(config.world_sizes, config.backend, config.device,
                                                            config.pools_per_gpu, _matrix_world_sizes())
        except PlacementError as exc:
            return self._refuse(str(exc))
        if crowded:
            print(f"harness nightly: warning: {crowded}", file=sys.stderr)
        try:
            self.part = select_part(config.selection, sorted(self.lanes), part=config.part,
                                    part_costs=config.part_costs, stored=self.stored,
                                    prepare=determinism_sample if config.determinism_sample else None)
        except PartError as exc:
            return self._refuse(str(exc))
        self.skipped = {ws: {"cases": _cases_in(config.selection, ws), "reason": why} for ws, why in skipped.items()}
        return None

    # -- 1. cases -------------------------------------------------------------------------------------

    def run_cases(self) -> int | None:
        """The part's cases the results file lacks, on the lanes (a fuzz campaign beside them where the
        cores allow); ``not_run.txt`` lists what a time budget left out."""
        from harness.collect.collector import ResultsLocked, ResultWriter, run_info

        config, out, part = self.config, self.out, self.part
        assert part is not None
        info = run_info([lane for group in self.lanes.values() for lane in group])
        try:
            writer = ResultWriter(self.results, info, resume=config.resume)
        except FileExistsError as exc:
            return self._refuse(f"{exc}; or pass --resume to continue that nightly")
        except ResultsLocked as exc:
            return self._refuse(f"--out: {exc}")
        cases_start = time.monotonic()
        beside = fuzz_alongside(self.lanes, host_facts().cpu_cores) and not _other_part(part.cut)
        # The budget holds the report too, and a share for a fuzz campaign that runs after the cases.
        fuzz_after = not beside and _fuzz_not_run(config, self.earlier, self.fuzz_path, None, part.cut) is None
        self.deadline = cases_deadline(self.start, config.time_budget_s, fuzz_after)
        if beside:
            budget = fuzz_budget(config.time_budget_s, time.monotonic() - self.start)
            if _fuzz_not_run(config, self.earlier, self.fuzz_path, budget) is None:
                # One bar on the terminal: the cases'.
                self.alongside = FuzzRun(config.fuzz_profile, config.fuzz_max_examples, self.fuzz_path, budget,
                                         progress=False).start()
        session = self.session = RunSession(
            writer, self.lanes, case_timeout_s=config.case_timeout_s, repeat=config.repeat,
            repeat_failures=config.repeat_failures, show_progress=config.progress, deadline=self.deadline,
            budget_s=config.time_budget_s, mps=config.mps)
        with session:
            if session.latest and part.stored is None:
                print(legacy_warning(self.results, session.latest.values()), file=sys.stderr)
            stored = part.store(self.results)
            self.state["selection"] = {"id": stored.id, "options": stored.options}
            if part.cut is not None:
                # "shard": nightly.json's key for the part since before "part" replaced it; kept so that
                # earlier nights and their merge (harness.cli.nightly_merge) read the same key.
                self.state["shard"] = {k: v for k, v in part.cut.items() if k != "case_ids"} | {"selected": len(part.selected)}
                print(f"harness nightly: {part.describe()} -> {out}", file=sys.stderr)
            todo = session.todo(part.cases)
            if self.deadline is not None:
                todo = sample_order(todo)  # a budget spent early has still seen every value of every axis
            if session.latest:
                print(f"resuming {out}: {len(part.cases) - len(todo)} of {len(part.cases)} cases already recorded",
                      file=sys.stderr)
            self.state["cases"] = {
                "selected": len(part.cases), "already_recorded": len(part.cases) - len(todo), "recorded": 0,
                "not_run": 0, "world_sizes": sorted(self.lanes), "backend": info.backend, "device": info.device,
                "ranks_per_gpu": info.ranks_per_gpu,
                "lanes": [{**dataclasses.asdict(lane), "device": lane.device} for group in self.lanes.values() for lane in group],
                "world_sizes_skipped": self.skipped, "order": "sampled" if self.deadline is not None else "generator",
            }
            self.save()
            gpus = {d for group in self.lanes.values() for lane in group for d in lane.devices or ()}
            sampler = HostSampler(gpus=sorted(gpus))
            try:
                sampler.start()
                session.run(todo)
            except KeyboardInterrupt as exc:
                self._stop_cases(interrupted=True)
                print(f"\ninterrupted; rerun with: {config.resume_line()}", file=sys.stderr)
                return interrupt_exit_status(exc)
            except MpsError as exc:  # --mps on where MPS cannot run: no pool started
                self._stop_cases(mps_error=str(exc))
                return self._refuse(str(exc))
            except OSError as exc:  # the results file could not be written (the runner's write_error)
                self._stop_cases(write_error=str(exc))
                kept = getattr(exc, "records_kept", True)  # not a ResultsFileGone
                print(f"harness nightly: {exc}" + (f"; the records written before it are kept: free space and rerun "
                                                    f"with: {config.resume_line()}" if kept else ""), file=sys.stderr)
                return 2
            finally:
                self.state["cases"]["host"] = sampler.stop()
                self.state["cases"]["mps"] = session.mps.to_dict()
        not_run = session.not_run
        _write_not_run(out / NOT_RUN_NAME, not_run)
        cases_wall = time.monotonic() - cases_start
        assert session.runner is not None
        self.state["cases"].update(
            recorded=session.recorded, not_run=len(not_run),
            not_run_reasons=dict(collections.Counter(why for _, why in not_run)),
            lane_errors=session.runner.lane_errors, wall_s=round(cases_wall, 3),
            pools_close_s=round(session.runner.close_s, 3),
            cases_per_s=round(session.recorded / cases_wall, 3) if cases_wall > 0 else None,
            breakdown=breakdown(session.records, session.records_s, cases_wall),
        )
        self.save()
        if not_run:
            print(f"harness nightly: {len(not_run)} case(s) not run, listed in {out / NOT_RUN_NAME}", file=sys.stderr)
        return None

    @property
    def fuzz_path(self) -> Path:
        return self.out / FUZZ_NAME

    def _stop_cases(self, **why: Any) -> None:
        """The cases stopped early (the session has stopped the lanes): the fuzz beside them stops too, and
        ``nightly.json`` says how far they got."""
        if self.alongside is not None:
            self.alongside.stop()
        assert self.session is not None
        self.state["cases"].update(recorded=self.session.recorded, **why)
        self.save()

    # -- 2. fuzz campaign and performance -------------------------------------------------------------

    def run_fuzz_campaign(self) -> int | None:
        """The fuzz campaign's outcome: waited for when it ran beside the cases, else run now (or why not)."""
        config = self.config
        if self.alongside is not None:
            self.state["fuzz"] = {**dataclasses.asdict(self.alongside.wait()), "alongside_cases": True}
        else:
            budget = fuzz_budget(config.time_budget_s, time.monotonic() - self.start)
            skip = _fuzz_not_run(config, self.earlier, self.fuzz_path, budget, self.cut)
            if skip is not None:
                self.state["fuzz"] = skip
            else:
                try:
                    self.state["fuzz"] = dataclasses.asdict(
                        run_fuzz(config.fuzz_profile, config.fuzz_max_examples, self.fuzz_path,
                                 fuzz_budget(config.time_budget_s, time.monotonic() - self.start), config.progress))
                except KeyboardInterrupt as exc:
                    self.save()
                    print(f"\ninterrupted; rerun with: {config.resume_line()}", file=sys.stderr)
                    return interrupt_exit_status(exc)
        self.save()
        return None

    def measure_perf(self) -> int | None:
        """The performance section: after the cases, so the GPUs are free."""
        from harness.perf import perf_section

        config = self.config
        if not config.perf:
            self.state["perf"] = {"skipped": "--no-perf"}
        elif _other_part(self.cut):
            self.state["perf"] = {"skipped": ONE_PART}
        elif config.resume and self.earlier.get("perf") and not self.earlier["perf"].get("skipped"):
            self.state["perf"] = self.earlier["perf"]
        elif self.deadline is not None and time.monotonic() > self.deadline:
            self.state["perf"] = {"skipped": f"time budget of {config.time_budget_s:g} s spent"}
        else:
            self.state["perf"] = perf_section.run_section(n_gpus())
        self.save()
        return None

    # -- 3. report, 4. diff ---------------------------------------------------------------------------

    def build_report(self) -> int | None:
        """The report of the results file; its plots stop where the budget, less a margin for the pages,
        tables and diff after them, ends."""
        import reports

        budget = self.config.time_budget_s
        t0 = time.monotonic()
        self.report = reports.build([self.results], self.out, plot_deadline=None if budget is None
                                    else self.start + budget - report_reserve(budget) / 2)
        self.state["verdicts"] = dict(self.report.verdicts)
        self.state["determinism"] = determinism_summary(_latest_records(self.results))
        self.state["report"] = {"files": self.report.files, "bad_lines": len(self.report.bad_lines),
                                "wall_s": round(time.monotonic() - t0, 3)}
        self.save()
        return None

    def diff_previous(self) -> int | None:
        """The diff against the previous night of the same selection, and the performance ratios."""
        import reports
        from harness.perf import perf_section
        from reports import render

        config, out, state = self.config, self.out, self.state
        selection_id = state["selection"]["id"]
        previous = self.previous = config.previous if config.previous is not None else find_previous(out, selection_id)
        other = night_selection(previous) if previous is not None and previous.is_dir() else None
        try:
            if self.cut is not None:
                raise ValueError(f"a part: the night's diff is the merge's (python -m harness nightly --out {config.out} --merge-parts)")
            if previous is None:
                raise ValueError(f"no earlier nightly of this selection ({selection_id}) next to {out}")
            if other is not None and other != selection_id:
                raise ValueError(f"{previous} is a night of another selection ({other}, this one {selection_id}); "
                                 "nights compare with nights of the same selection")
            old = baseline_source(previous)
            t0 = time.monotonic()
            result = reports.diff(old, self.results)
        except ValueError as exc:  # nothing to compare with: said, never a regression
            state["diff"] = {"previous": None, "note": str(exc)}
            for stale in (out / DIFF_MD_NAME, out / DIFF_JSON_NAME):
                stale.unlink(missing_ok=True)
        else:
            text = render.diff_markdown(result, str(old), str(self.results))
            (out / DIFF_MD_NAME).write_text(text, encoding="utf-8")
            write_json(out / DIFF_JSON_NAME, result.to_dict())
            self.regressions = len(result.regressions)
            state["diff"] = {
                "previous": str(old), "exit_code": result.exit_code,
                "counts": result.to_dict()["counts"], "wall_s": round(time.monotonic() - t0, 3),
            }
        perf_diff = perf_section.compare_sections(perf_section.previous_section(previous), state["perf"])
        state["perf_diff"] = perf_diff.to_dict()
        self.regressions += len(perf_diff.regressions)
        self.save()
        return None

    # -- 5. verdict -----------------------------------------------------------------------------------

    def conclude(self) -> int:
        """The exit status and its reasons into ``nightly.json``, and the summary printed."""
        assert self.session is not None
        part = self.cut
        code, reasons = exit_status(self.report.verdicts, self.state["fuzz"].get("exit_code"), self.regressions,
                                    self.session.pools_failed, empty_part=part is not None and not part["case_ids"])
        partial = partial_reasons(self.state)
        # ``finished``: it ran to its end; ``complete``: and left nothing out (cases, fuzz, perf).
        self.state.update(complete=not partial, exit_code=code, exit_reasons=reasons, partial=partial,
                          finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        self.save()
        print(_summary_text(self.state))
        return code


def _other_part(part: Mapping[str, Any] | None) -> bool:
    """A part but the first: the fuzz campaign and the performance section run once per night, on part 1."""
    return part is not None and part["index"] != 0


def _fuzz_not_run(config: NightlyConfig, earlier: Mapping[str, Any], path: Path, budget: float | None,
                  part: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """``nightly.json``'s ``fuzz`` when the campaign is not to run now (and why), else None."""
    if config.fuzz_profile == "none":
        return dataclasses.asdict(FuzzOutcome("none", config.fuzz_max_examples, skipped="--fuzz-profile none"))
    if _other_part(part):
        return dataclasses.asdict(FuzzOutcome(config.fuzz_profile, config.fuzz_max_examples, skipped=ONE_PART))
    if config.resume and earlier.get("fuzz", {}).get("exit_code") is not None and path.exists():
        return {**earlier["fuzz"], "resumed_from_earlier_attempt": True}
    if budget is not None and budget <= 0:
        return dataclasses.asdict(FuzzOutcome(
            config.fuzz_profile, config.fuzz_max_examples, time_budget_s=0.0,
            skipped=f"time budget of {config.time_budget_s:g} s spent by the cases"))
    return None


def _latest_records(path: Path) -> list[Any]:
    """The newest record of every case in a results file."""
    from harness.collect.collector import read_records, record_full_id

    latest = {}
    for record in read_records(path)[0]:
        latest[record_full_id(record)] = record
    return list(latest.values())


def _write_not_run(path: Path, not_run: Sequence[tuple[CaseConfig, str]]) -> None:
    if not not_run:
        path.unlink(missing_ok=True)  # a resumed nightly that ran them all
        return
    path.write_text(not_run_text(not_run), encoding="utf-8")


def _summary_text(state: Mapping[str, Any]) -> str:
    from tabulate import tabulate

    from harness.perf import perf_section

    cases, fuzz, diff = state["cases"], state["fuzz"], state["diff"]
    verdicts = [(v, n) for v, n in state["verdicts"].items() if n]
    lines = [tabulate(verdicts, headers=("verdict", "cases")) if verdicts else "no cases recorded"]
    rate = cases.get("cases_per_s")
    lines.append(
        f"cases: {cases['selected']} selected, {cases['already_recorded']} already recorded, "
        f"{cases['recorded']} run now in {cases.get('wall_s', 0):.1f} s "
        f"({rate if rate is not None else '-'} cases/s on {len(cases['lanes'])} pools), {cases['not_run']} not run"
    )
    if cases.get("breakdown", {}).get("cases"):
        lines += [breakdown_table(cases["breakdown"]), host_text(cases["host"])]
    if cases.get("mps"):  # nights from before it was recorded have none
        lines.append(MpsState(**cases["mps"]).describe())
    determinism = state.get("determinism") or {}
    if determinism.get("configurations"):
        checked = sum(v["checked"] for v in determinism["configurations"].values())
        bad = determinism["nondeterministic"]
        lines.append(f"determinism: {checked} cases checked over {len(determinism['configurations'])} engine/strategy "
                     f"configurations; nondeterministic: {', '.join(bad) if bad else 'none'}")
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
    lines += perf_section.summary_lines(state.get("perf"), state.get("perf_diff"))
    partial = partial_reasons(state)
    verdict = "; ".join(state["exit_reasons"]) if state["exit_code"] else f"partial: {'; '.join(partial)}" if partial else "ok"
    lines.append(f"nightly {verdict} (exit {state['exit_code']}) in {state['wall_s']:.1f} s -> {state['out']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The selection options and the nightly's own."""
    add_selection(p)
    p.set_defaults(matrix="full")
    p.add_argument("--out", required=True, type=non_empty_path, help="the nightly's directory, e.g. reports/nightly/$(date +%%F)")
    p.add_argument("--resume", action="store_true", help="continue the nightly in --out (recorded cases and a finished fuzz are kept)")
    p.add_argument("--previous", type=Path, default=None,
                   help="nightly directory or results file to diff against (default: the newest earlier sibling of --out)")
    p.add_argument("--fuzz-profile", default="nightly", choices=("nightly", "ci", "dev", "none"),
                   help="Hypothesis profile of the fuzz campaign; none skips it")
    p.add_argument("--fuzz-max-examples", type=int, default=None, help="examples per fuzz property, overriding the profile")
    p.add_argument("--time-budget-s", type=budget_seconds, default=None,
                   help="the whole nightly's seconds: cases run sampled (every value of every axis early, then every pair) "
                        "and none starts after the budget (the rest are listed in not_run.txt); the fuzz campaign "
                        "gets what is left less 30 s for the report")
    add_placement(p)
    add_case_timeout(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-determinism-sample", action="store_true",
                   help="do not check determinism on the sample of one case per engine, strategy and world size")
    add_execution(p)
    p.add_argument("--no-perf", action="store_true", help="skip the performance section (step time and memory against torch FSDP1)")
    add_part_options(p, "each part writes OUT/shards/K-of-N; the fuzz campaign and the performance section run on part 1")
    add_alias(p, "--merge-shards", "merge_parts", action="store_true")
    p.add_argument("--merge-parts", dest="merge_parts", action="store_true",
                   help="merge the parts in OUT/shards into the night: report, diff and nightly.json in OUT; "
                        "exit 1 when a part is missing or unfinished")


def config_from_args(args: argparse.Namespace) -> NightlyConfig | None:
    """The nightly's configuration, ``--part auto`` read from the environment; None (said in one line)
    when an option cannot work."""
    try:
        args.part = resolve_part(args.part)
        return NightlyConfig.from_args(args)
    except ValueError as exc:  # a PartError too
        print(f"harness nightly: {exc}", file=sys.stderr)
        return None


def main(args: argparse.Namespace) -> int:
    if under_torchrun():
        print("harness nightly: start it without torchrun; it starts its own ranks (one pool per group of GPUs)",
              file=sys.stderr)
        return 2
    config = config_from_args(args)
    if config is None:
        return 2
    return nightly(config)
