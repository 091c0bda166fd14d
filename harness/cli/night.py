"""A night on disk and how it is judged: the files a nightly writes, the previous night it compares with,
the determinism sample and summary, its exit status and what it left out. Pure logic over plain data,
and the two JSON helpers every nightly file goes through (``harness.cli.nightly`` runs the phases)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.cases.case import CaseConfig
from harness.cases.records import FAILING

RESULTS_NAME = "results.jsonl"
FUZZ_NAME = "fuzz.txt"
NIGHTLY_NAME = "nightly.json"
NOT_RUN_NAME = "not_run.txt"
DIFF_MD_NAME = "diff.md"
DIFF_JSON_NAME = "diff.json"
#: why a part but the first skips the fuzz campaign and the performance section (not a partial night).
ONE_PART = "run once per night, by part 1"
#: ``ONE_PART`` as nights written before "part" replaced "shard" stored it; still read as ``ONE_PART``.
ONE_PART_EARLIER = "run once per night, by shard 1"


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
    from harness.collect.collector import record_full_id

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
    part that holds no case (more parts than cases), which has nothing to run."""
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
        if skipped and skipped not in (chosen, ONE_PART, ONE_PART_EARLIER):
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
