"""``python -m harness nightly --out reports/nightly/<date>``: the whole nightly in one command.

One straight line, every product written into the out directory as it is made:

1. the cases of the matrix (``full`` by default) on every local GPU (several pools on each group of
   GPUs side by side, as many as ``harness.placement.pools_per_group`` allows or ``--pools-per-gpu``
   says), or on gloo ranks on CPU when there are no GPUs: ``results.jsonl``, one durable line per case
   (a killed nightly keeps every case it finished; ``--resume`` goes on). Determinism is checked on a
   sample (``determinism_sample``); ``--repeat``/``--repeat-failures`` rerun cases (``flaky`` verdicts);
   under ``--time-budget-s`` the cases run in sampled order (``harness.sampling.sample_order``: every value
   of every axis first, then every pair);
2. the flat-parameter fuzz campaign (``harness.conformance.fuzz_campaign``, profile ``nightly``; under a time
   budget what is left of it, ``fuzz_budget``, after the cases at least ``FUZZ_SHARE``): ``fuzz.txt``;
   then the performance section (``harness.perf_section``): step time and peak memory of our engine
   and torch FSDP1 on two GPUs, or a smoke check on CPU, kept under ``perf`` in ``nightly.json``;
3. the report (``reports.build``): ``matrix.md``, ``matrix.html``, ``results.csv``, heatmaps, ``summary.json``;
4. the diff against the previous nightly (the newest sibling directory holding a ``nightly.json`` whose
   name sorts before this one, or ``--previous``): ``diff.md``, ``diff.json``; and its performance ratios
   (a ratio to torch FSDP1 more than 5% worse on the same device is a regression): ``perf_diff``;
5. ``nightly.json``: counts per verdict, cases per second, wall times, nondeterministic engines per
   configuration, what was not run and why (rewritten after every phase; ``finished`` is set at the end,
   ``complete`` is true only when nothing was left out: every case, the fuzz campaign and the
   performance section that were asked for); ``not_run.txt`` lists the cases a time budget left out.

With ``--shard K/N`` the nightly runs the K-th part of the selection (``harness.shards``) into
``OUT/shards/K-of-N``, the fuzz campaign and the performance section on shard 1 only and no diff;
``--merge-shards`` (``harness.cli.nightly_merge``) makes the night of the shards in ``OUT``; ``--submit``
(``harness.cli.nightly_submit``) runs the shards as one submitit job array, then merges them.

Exit status: 0 when every case passed or is unsupported (a flaky case is bad), the fuzz campaign passed and nothing regressed
against the previous nightly; 1 otherwise; 2 when the results file exists without ``--resume`` or the
ranks could not start, ``--out`` cannot be the nightly's directory, or the results file could not be
written; 130 on Ctrl-C, 143 on SIGTERM and 129 on SIGHUP (rerun with the shell-quoted ``--resume`` line printed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.case import CaseConfig
from harness.cli.fuzz import FuzzOutcome, FuzzRun, cases_deadline, fuzz_alongside, fuzz_budget, report_reserve, run_fuzz
from harness.cli.nightly_config import NightlyConfig, resumed_config
from harness.cli.options import add_execution, add_placement, add_selection, budget_seconds, non_empty_path, positive_float
from harness.cli.sharding import add_sharding, cut_shard, resolve_shard, shard_dir, shard_text
from harness.cli.signals import interrupt_exit_status, terminate_as_interrupt
from harness.placement import (
    PlacementError,
    available_memory,
    cpu_pool_check,
    host_facts,
    n_gpus,
    plan_lanes,
)
from harness.records import FAILING, not_run_text
from harness.runner import (
    CaseRunner,
    Progress,
    Selection,
    SelectionError,
    select_cases,
    under_torchrun,
)
from harness.sampling import sample_order
from harness.shards import ShardError
from harness.stored_selection import (
    StoredSelection, StoredSelectionError, legacy_warning, read_selection, selection_options, write_selection,
)

RESULTS_NAME = "results.jsonl"
FUZZ_NAME = "fuzz.txt"
NIGHTLY_NAME = "nightly.json"
NOT_RUN_NAME = "not_run.txt"
DIFF_MD_NAME = "diff.md"
DIFF_JSON_NAME = "diff.json"
#: why a shard but the first skips the fuzz campaign and the performance section (not a partial night).
ONE_SHARD = "run once per night, by shard 1"


# ---------------------------------------------------------------------------------------------------
# Pure logic


def night_selection(directory: Path) -> str | None:
    """The selection id a nightly directory's ``nightly.json`` records; None for none or an older one."""
    selection = read_json(Path(directory) / NIGHTLY_NAME).get("selection")
    return selection.get("id") if isinstance(selection, dict) else None


def find_previous(out: Path, selection_id: str | None = None) -> Path | None:
    """The newest earlier nightly: the sibling directory of ``out`` holding a ``nightly.json`` (what
    only a nightly writes, so a results directory of ``harness run`` next to it is never taken) whose
    name sorts last among those before ``out``'s name (date names, ``2026-11-21``, sort by date); with
    ``selection_id``, among the nights of that selection only (another selection is no baseline)."""
    out = Path(out)
    parent = out.parent
    if not parent.is_dir():
        return None
    earlier = [d for d in parent.iterdir() if d.is_dir() and d.name < out.name and (d / NIGHTLY_NAME).is_file()
               and (selection_id is None or night_selection(d) == selection_id)]
    return max(earlier, key=lambda d: d.name) if earlier else None


def determinism_sample(cases: Sequence[CaseConfig]) -> list[CaseConfig]:
    """The cases with determinism checked on the first of every engine, strategy and world size.

    Checking runs the engine twice, so the nightly checks a sample; the same cases (same ids) every
    night, so the sample's records compare with the previous nightly's."""
    seen: set[tuple[str, str, int]] = set()
    out = []
    for case in cases:
        key = (case.engine, case.sharding_strategy, case.world_size)
        if key not in seen:
            seen.add(key)
            case = case.replace(check_determinism=True)
        out.append(case)
    return out


def determinism_summary(records: Sequence[Any]) -> dict[str, Any]:
    """Per engine and strategy (``builtin/full_shard``): cases checked and the nondeterministic ones."""
    from harness.collector import record_full_id

    table: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.deterministic is None:
            continue
        key = f"{record.case['engine']}/{record.case['sharding_strategy']}"
        entry = table.setdefault(key, {"checked": 0, "nondeterministic": []})
        entry["checked"] += 1
        if record.deterministic is False:
            entry["nondeterministic"].append(record_full_id(record))
    return {"configurations": dict(sorted(table.items())),
            "nondeterministic": sorted(k for k, v in table.items() if v["nondeterministic"])}


def baseline_source(previous: Path) -> Path:
    """What ``reports.diff`` should read of a previous nightly: its report directory when it has one
    (``results.csv``), else its raw results (a nightly killed before its report), else the path itself."""
    previous = Path(previous)
    if previous.is_dir() and not (previous / "results.csv").exists() and (previous / RESULTS_NAME).exists():
        return previous / RESULTS_NAME
    return previous


def exit_status(verdicts: Mapping[str, int], fuzz_exit: int | None, regressions: int, pools_failed: bool,
                empty_part: bool = False) -> tuple[int, list[str]]:
    """The nightly's exit status and the reasons for it (see the module docstring); ``empty_part``: a
    shard whose part holds no case (more shards than cases), which has nothing to run."""
    reasons: list[str] = []
    if not sum(verdicts.values()) and not empty_part:
        reasons.append("no case was run")  # an empty nightly checked nothing: never a green one
    bad = {v: verdicts.get(v, 0) for v in FAILING if verdicts.get(v, 0)}
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


def partial_reasons(state: Mapping[str, Any]) -> list[str]:
    """What a nightly left out of what it was asked for (cases not run, a fuzz campaign or performance
    section skipped for the budget): a nightly that left something out never reads as ``ok``."""
    cases, out = state.get("cases") or {}, []
    if cases.get("not_run"):
        out.append(f"{cases['not_run']} of {cases.get('selected', '?')} cases not run")
    for phase, chosen in (("fuzz", "--fuzz-profile none"), ("perf", "--no-perf")):
        skipped = (state.get(phase) or {}).get("skipped")
        if skipped and skipped not in (chosen, ONE_SHARD):
            out.append(f"{phase} skipped ({skipped})")
    return out


# ---------------------------------------------------------------------------------------------------
# Side effects


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    # Atomic: a nightly killed mid-write keeps the previous version, never half a file.
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _matrix_world_sizes() -> list[int]:
    from harness.matrix import AXES

    return list(AXES["world_size"])


def out_dir_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the nightly's directory (checked before anything runs), or None."""
    from harness.collector import out_path_problem

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
            return _nightly(config)
        except KeyboardInterrupt as exc:  # between phases; the phases say where they stopped
            print(f"\ninterrupted; rerun with: {config.resume_line()}", file=sys.stderr)
            return interrupt_exit_status(exc)


def _nightly(config: NightlyConfig) -> int:
    from harness.collector import ResultsLocked, ResultWriter, run_info

    start = time.monotonic()
    out = shard_dir(config.out, config.shard)
    problem = out_dir_problem(out)
    if problem:
        print(f"harness nightly: --out: {problem}", file=sys.stderr)
        return 2
    state_path, stored = out / NIGHTLY_NAME, None
    earlier = read_json(state_path) if config.resume else {}
    if config.resume:
        try:
            if not (out / RESULTS_NAME).exists():  # a typo must not start a fresh night
                raise StoredSelectionError(f"{out / RESULTS_NAME} does not exist, so there is no nightly to continue; "
                                           "check --out, or drop --resume to start one")
            stored = read_selection(out / RESULTS_NAME)
            config = resumed_config(config, stored.options if stored else None, earlier.get("config") or {},
                                    config.given_options)
        except ValueError as exc:  # SelectionError, StoredSelectionError
            print(f"harness nightly: {'--resume: ' * isinstance(exc, StoredSelectionError)}{exc}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {
        "out": str(out), "complete": False, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resumed": config.resume, "config": config.to_dict(),
    }

    def save() -> None:
        state["wall_s"] = round(time.monotonic() - start, 3)
        write_json(state_path, state)

    # -- 1. cases ---------------------------------------------------------------------------------
    host = host_facts()
    try:
        lanes, skipped_ws = plan_lanes(config.world_sizes, config.backend, n_gpus(), _matrix_world_sizes(),
                                       device=config.device, host=host, pools=config.pools_per_gpu)
    except PlacementError as exc:
        print(f"harness nightly: {exc}", file=sys.stderr)
        return 2
    refused, crowded = cpu_pool_check(lanes, os.cpu_count() or 1, available_memory())
    if refused:
        print(f"harness nightly: {refused}", file=sys.stderr)
        return 2
    if crowded:
        print(f"harness nightly: warning: {crowded}", file=sys.stderr)
    selection = config.selection
    cases = select_cases(selection, list(lanes))
    if config.determinism_sample:
        cases = determinism_sample(cases)
    selected = cases
    selection_id = stored.id if stored else StoredSelection(selection_options(selection, sorted(lanes)), tuple(c.full_id for c in cases)).id
    try:
        cases, shard = cut_shard(config, cases, selection_id, stored)
    except ShardError as exc:
        print(f"harness nightly: {exc}", file=sys.stderr)
        return 2
    skipped = {ws: {"cases": _cases_in(selection, ws), "reason": why} for ws, why in skipped_ws.items()}
    info = run_info([lane for group in lanes.values() for lane in group])
    try:
        writer = ResultWriter(out / RESULTS_NAME, info, resume=config.resume)
    except FileExistsError as exc:
        print(f"harness nightly: {exc}; or pass --resume to continue that nightly", file=sys.stderr)
        return 2
    except ResultsLocked as exc:
        print(f"harness nightly: --out: {exc}", file=sys.stderr)
        return 2
    cases_start = time.monotonic()
    fuzz_path = out / FUZZ_NAME
    beside = fuzz_alongside(lanes, host.cpu_cores) and not _other_shard(shard)
    # The budget holds the report too, and a share for a fuzz campaign that runs after the cases.
    fuzz_after = not beside and _fuzz_not_run(config, earlier, fuzz_path, None, shard) is None
    deadline = cases_deadline(start, config.time_budget_s, fuzz_after)
    alongside: FuzzRun | None = None
    if beside:
        budget = fuzz_budget(config.time_budget_s, time.monotonic() - start)
        if _fuzz_not_run(config, earlier, fuzz_path, budget) is None:
            alongside = FuzzRun(config.fuzz_profile, config.fuzz_max_examples, fuzz_path, budget, progress=False).start()  # one bar on the terminal: the cases'
    with writer:
        if writer.resumed and stored is None:
            print(legacy_warning(out / RESULTS_NAME, writer.resumed.values()), file=sys.stderr)
        if stored is None:
            stored = StoredSelection(selection_options(selection, sorted(lanes)), tuple(c.full_id for c in selected), shard)
            write_selection(out / RESULTS_NAME, stored)
        state["selection"] = {"id": stored.id, "options": stored.options}
        if shard is not None:
            state["shard"] = {k: v for k, v in shard.items() if k != "case_ids"} | {"selected": len(selected)}
            print(f"harness nightly: {shard_text(shard, len(selected))} -> {out}", file=sys.stderr)
        done = writer.recorded_ids()
        todo = [c for c in cases if c.full_id not in done]
        if deadline is not None:
            todo = sample_order(todo)  # a budget spent early has still seen every value of every axis
        if done:
            print(f"resuming {out}: {len(cases) - len(todo)} of {len(cases)} cases already recorded", file=sys.stderr)
        state["cases"] = {
            "selected": len(cases), "already_recorded": len(cases) - len(todo), "recorded": 0, "not_run": 0,
            "world_sizes": sorted(lanes), "backend": info.backend, "device": info.device,
            "ranks_per_gpu": info.ranks_per_gpu,
            "lanes": [{**dataclasses.asdict(lane), "device": lane.device} for group in lanes.values() for lane in group],
            "world_sizes_skipped": skipped, "order": "sampled" if deadline is not None else "generator",
        }
        save()
        progress = Progress(len(todo), enabled=config.progress, deadline=deadline)
        runner = CaseRunner(writer, progress, deadline, config.case_timeout_s,
                            repeat=config.repeat, repeat_failures=config.repeat_failures)
        try:
            not_run, pools_failed = runner.run_all(lanes, todo, config.time_budget_s)
            writer.check_present()  # deleted after its last record: the report would read a file that is gone
        except KeyboardInterrupt as exc:
            runner.interrupt()
            if alongside is not None:
                alongside.stop()
            progress.close()
            state["cases"].update(recorded=runner.recorded, interrupted=True)
            save()
            print(f"\ninterrupted; rerun with: {config.resume_line()}", file=sys.stderr)
            return interrupt_exit_status(exc)
        except OSError as exc:  # the results file could not be written (runner.write_error)
            runner.interrupt()
            if alongside is not None:
                alongside.stop()
            progress.close()
            state["cases"].update(recorded=runner.recorded, write_error=str(exc))
            save()
            kept = getattr(exc, "records_kept", True)  # not a ResultsFileGone
            print(f"harness nightly: {exc}" + (f"; the records written before it are kept: free space and rerun "
                                                f"with: {config.resume_line()}" if kept else ""), file=sys.stderr)
            return 2
        progress.close()
    _write_not_run(out / NOT_RUN_NAME, not_run)
    cases_wall = time.monotonic() - cases_start
    state["cases"].update(
        recorded=runner.recorded, not_run=len(not_run),
        not_run_reasons=dict(collections.Counter(why for _, why in not_run)),
        lane_errors=runner.lane_errors, wall_s=round(cases_wall, 3),
        cases_per_s=round(runner.recorded / cases_wall, 3) if cases_wall > 0 else None,
    )
    save()
    if not_run:
        print(f"harness nightly: {len(not_run)} case(s) not run, listed in {out / NOT_RUN_NAME}", file=sys.stderr)

    # -- 2. fuzz campaign -------------------------------------------------------------------------
    if alongside is not None:
        state["fuzz"] = {**dataclasses.asdict(alongside.wait()), "alongside_cases": True}
    else:
        skip = _fuzz_not_run(config, earlier, fuzz_path, fuzz_budget(config.time_budget_s, time.monotonic() - start), shard)
        if skip is not None:
            state["fuzz"] = skip
        else:
            try:
                state["fuzz"] = dataclasses.asdict(
                    run_fuzz(config.fuzz_profile, config.fuzz_max_examples, fuzz_path,
                             fuzz_budget(config.time_budget_s, time.monotonic() - start), config.progress))
            except KeyboardInterrupt as exc:
                save()
                print(f"\ninterrupted; rerun with: {config.resume_line()}", file=sys.stderr)
                return interrupt_exit_status(exc)
    save()

    # -- 2b. performance: after the cases, so the GPUs are free ---------------------------------------
    from harness import perf_section

    if not config.perf:
        state["perf"] = {"skipped": "--no-perf"}
    elif _other_shard(shard):
        state["perf"] = {"skipped": ONE_SHARD}
    elif config.resume and earlier.get("perf") and not earlier["perf"].get("skipped"):
        state["perf"] = earlier["perf"]
    elif deadline is not None and time.monotonic() > deadline:
        state["perf"] = {"skipped": f"time budget of {config.time_budget_s:g} s spent"}
    else:
        state["perf"] = perf_section.run_section(n_gpus())
    save()

    # -- 3. report ----------------------------------------------------------------------------------
    import reports
    from reports import render

    t0 = time.monotonic()
    # The budget's end, less a margin for the pages, tables and diff after the plots.
    summary = reports.build([out / RESULTS_NAME], out, plot_deadline=None if config.time_budget_s is None
                            else start + config.time_budget_s - report_reserve(config.time_budget_s) / 2)
    state["verdicts"] = dict(summary.verdicts)
    state["determinism"] = determinism_summary(_latest_records(out / RESULTS_NAME))
    state["report"] = {"files": summary.files, "bad_lines": len(summary.bad_lines), "wall_s": round(time.monotonic() - t0, 3)}
    save()

    # -- 4. diff against the previous nightly -------------------------------------------------------
    previous = config.previous if config.previous is not None else find_previous(out, stored.id)
    regressions = 0
    other = night_selection(previous) if previous is not None and previous.is_dir() else None
    try:
        if shard is not None:
            raise ValueError(f"a shard: the night's diff is the merge's (python -m harness nightly --out {config.out} --merge-shards)")
        if previous is None:
            raise ValueError(f"no earlier nightly of this selection ({stored.id}) next to {out}")
        if other is not None and other != stored.id:
            raise ValueError(f"{previous} is a night of another selection ({other}, this one {stored.id}); "
                             "nights compare with nights of the same selection")
        old = baseline_source(previous)
        t0 = time.monotonic()
        result = reports.diff(old, out / RESULTS_NAME)
    except ValueError as exc:  # nothing to compare with: said, never a regression
        state["diff"] = {"previous": None, "note": str(exc)}
        for stale in (out / DIFF_MD_NAME, out / DIFF_JSON_NAME):
            stale.unlink(missing_ok=True)
    else:
        text = render.diff_markdown(result, str(old), str(out / RESULTS_NAME))
        (out / DIFF_MD_NAME).write_text(text, encoding="utf-8")
        write_json(out / DIFF_JSON_NAME, result.to_dict())
        regressions = len(result.regressions)
        state["diff"] = {
            "previous": str(old), "exit_code": result.exit_code,
            "counts": result.to_dict()["counts"], "wall_s": round(time.monotonic() - t0, 3),
        }
    perf_diff = perf_section.compare_sections(perf_section.previous_section(previous), state["perf"])
    state["perf_diff"] = perf_diff.to_dict()
    regressions += len(perf_diff.regressions)
    save()

    # -- 5. verdict ---------------------------------------------------------------------------------
    fuzz_exit = state["fuzz"].get("exit_code")
    code, reasons = exit_status(summary.verdicts, fuzz_exit, regressions, pools_failed,
                                empty_part=shard is not None and not shard["case_ids"])
    partial = partial_reasons(state)
    # ``finished``: it ran to its end; ``complete``: and left nothing out (cases, fuzz, perf).
    state.update(complete=not partial, exit_code=code, exit_reasons=reasons, partial=partial,
                 finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    save()
    print(_summary_text(state))
    return code


def _other_shard(shard: Mapping[str, Any] | None) -> bool:
    """A shard but the first: the fuzz campaign and the performance section run once per night, on shard 1."""
    return shard is not None and shard["index"] != 0


def _fuzz_not_run(config: NightlyConfig, earlier: Mapping[str, Any], path: Path, budget: float | None,
                  shard: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """``nightly.json``'s ``fuzz`` when the campaign is not to run now (and why), else None."""
    if config.fuzz_profile == "none":
        return dataclasses.asdict(FuzzOutcome("none", config.fuzz_max_examples, skipped="--fuzz-profile none"))
    if _other_shard(shard):
        return dataclasses.asdict(FuzzOutcome(config.fuzz_profile, config.fuzz_max_examples, skipped=ONE_SHARD))
    if config.resume and earlier.get("fuzz", {}).get("exit_code") is not None and path.exists():
        return {**earlier["fuzz"], "resumed_from_earlier_attempt": True}
    if budget is not None and budget <= 0:
        return dataclasses.asdict(FuzzOutcome(
            config.fuzz_profile, config.fuzz_max_examples, time_budget_s=0.0,
            skipped=f"time budget of {config.time_budget_s:g} s spent by the cases"))
    return None


def _latest_records(path: Path) -> list[Any]:
    """The newest record of every case in a results file."""
    from harness.collector import read_records, record_full_id

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

    from harness import perf_section

    cases, fuzz, diff = state["cases"], state["fuzz"], state["diff"]
    verdicts = [(v, n) for v, n in state["verdicts"].items() if n]
    lines = [tabulate(verdicts, headers=("verdict", "cases")) if verdicts else "no cases recorded"]
    rate = cases.get("cases_per_s")
    lines.append(
        f"cases: {cases['selected']} selected, {cases['already_recorded']} already recorded, "
        f"{cases['recorded']} run now in {cases.get('wall_s', 0):.1f} s "
        f"({rate if rate is not None else '-'} cases/s on {len(cases['lanes'])} pools), {cases['not_run']} not run"
    )
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
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per case before it is a timeout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-determinism-sample", action="store_true",
                   help="do not check determinism on the sample of one case per engine, strategy and world size")
    add_execution(p)
    p.add_argument("--no-perf", action="store_true", help="skip the performance section (step time and memory against torch FSDP1)")
    add_sharding(p, "each shard writes OUT/shards/K-of-N; the fuzz campaign and the performance section run on shard 1")
    p.add_argument("--merge-shards", action="store_true",
                   help="merge the shards in OUT/shards into the night: report, diff and nightly.json in OUT; "
                        "exit 1 when a shard is missing or unfinished")


def config_from_args(args: argparse.Namespace) -> NightlyConfig | None:
    """The nightly's configuration, ``--shard auto`` read from the environment; None (said in one line)
    when an option cannot work."""
    try:
        args.shard = resolve_shard(args.shard)
        return NightlyConfig.from_args(args)
    except ValueError as exc:  # a ShardError too
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
