"""Three synthetic nightly directories for the history tests and the example under reports/examples/history/.

Over the smoke cases of both references (nested model): on the middle night one case that failed on
the first night passes (fixed), on the last night one case that passed before fails (regressed), and
one case times out every night. The middle night ran out of its time budget (``nightly.json`` and
``not_run.txt`` say so), and every night measured a step-time ratio (``perf``).
"""

from __future__ import annotations

import json
from pathlib import Path

from synthetic_records import RUN, record

from harness.cases.case import CaseConfig
from harness.cases.records import not_run_text
from harness.collect.collector import ResultWriter
from harness.run.stored_selection import StoredSelection, write_selection
from harness.selection.matrix import generate

NIGHTS = ("2026-11-20", "2026-11-21", "2026-11-22")


def night_cases() -> list[CaseConfig]:
    cases = {c.full_id: c for ref in ("ddp", "local") for c in generate("smoke", model="nested", reference=ref)}
    return list(cases.values())


def fixed_case() -> CaseConfig:
    return night_cases()[1]


def regressed_case() -> CaseConfig:
    return night_cases()[2]


def hung_case() -> CaseConfig:
    return night_cases()[3]


def write_nights(root: Path) -> list[Path]:
    """Write the three nights under ``root``; returns their directories, oldest first."""
    cases = night_cases()
    fixed, regressed, hung = fixed_case(), regressed_case(), hung_case()
    dirs = []
    for n, name in enumerate(NIGHTS):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        not_run = cases[-2:] if n == 1 else []
        with ResultWriter(d / "results.jsonl", RUN) as writer:
            for i, case in enumerate(cases):
                if case in not_run:
                    continue
                if case == fixed and n == 0:
                    r = record(case, "fail", 37.0, reason="grad:0.weight: max_abs 3.7e-4 exceeds atol 1e-05", time=n + 1.0)
                elif case == regressed and n == 2:
                    r = record(case, "fail", 12.0, reason="loss@4: max_abs 1.2e-4 exceeds atol 1e-05", time=n + 1.0)
                elif case == hung:
                    r = record(case, "timeout", None, reason="no answer within 300 s; rank 1 in all_gather", time=n + 1.0)
                else:
                    r = record(case, "pass", 0.01 * (i % 7) * (n + 1), time=n + 1.0)
                writer.append(r)
        stored = StoredSelection({"matrix": "smoke", "models": ["nested"]}, tuple(c.full_id for c in cases))
        write_selection(d / "results.jsonl", stored)
        state = {
            "out": f"reports/nightly/{name}", "complete": True, "selection": {"id": stored.id, "options": stored.options},
            "cases": {"selected": len(cases), "recorded": len(cases) - len(not_run), "not_run": len(not_run),
                      "not_run_reasons": {"time budget of 240 s spent": len(not_run)} if not_run else {},
                      "world_sizes_skipped": {}},
            "perf": {"step_time_ratio": {"full_shard": 1.05 + 0.01 * n, "shard_grad_op": 1.06 - 0.02 * n}},
        }
        (d / "nightly.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        if not_run:
            (d / "not_run.txt").write_text(not_run_text((c, "time budget of 240 s spent") for c in not_run))
        dirs.append(d)
    return dirs
