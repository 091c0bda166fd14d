"""``python -m harness nightly --out NIGHT --merge-parts``: the night of a nightly run in parts, once they ran.

Each part (``nightly --part K/N``) wrote ``NIGHT/shards/K-of-N``; the merge reads them all and writes the
night's products into ``NIGHT`` as a whole nightly does: the report over every part's results (the banner
names a missing or unfinished part, ``reports.scope.part_problems``), ``not_run.txt``, the diff against
the previous night of the same selection, and ``nightly.json`` (its ``shards`` section, named so since
before "part" replaced "shard", says which parts were merged and what is missing), so that the next
night's diff and ``reports history`` read a merged night as any other. Parts of different partitions are
refused (exit 2).

Exit status: 1 when a part is missing or unfinished, a case did not pass, part 1's fuzz campaign failed or
a case regressed; 2 when there is no part to merge or the parts are of different partitions; else 0.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from harness.cli.night import (
    DIFF_JSON_NAME,
    DIFF_MD_NAME,
    NIGHTLY_NAME,
    NOT_RUN_NAME,
    RESULTS_NAME,
    baseline_source,
    exit_status,
    find_previous,
    night_selection,
    partial_reasons,
    read_json,
    write_json,
)
from harness.cli.nightly import config_from_args
from harness.cli.nightly import main as nightly_main
from harness.cli.nightly_config import NightlyConfig
from harness.cli.part_options import PARTS_DIR

__all__ = ["main", "merge_parts"]


def main(args: Any) -> int:
    """The ``nightly`` command: ``--merge-parts`` merges a night run in parts, else the nightly runs
    (``harness.cli.nightly.main``); here, so that the nightly needs nothing of its merge."""
    if not args.merge_parts:
        return nightly_main(args)
    config = config_from_args(args)
    return 2 if config is None else merge_parts(config)


def _fail(message: str) -> int:
    print(f"harness nightly --merge-parts: {message}", file=sys.stderr)
    return 2


def merge_parts(config: NightlyConfig) -> int:
    """Merge the parts under ``config.out`` into one night; returns the exit status (module docstring)."""
    import reports
    from harness.run.stored_selection import read_selection
    from reports import render
    from reports.scope import PARTS_KEY

    start = time.monotonic()
    out = config.out
    if config.part is not None:
        return _fail("--part: a merge reads every part; drop --part")
    part_dirs = sorted(d for d in (out / PARTS_DIR).glob("*") if (d / RESULTS_NAME).is_file())
    if not part_dirs:
        return _fail(f"--out {out}: no part in {out / PARTS_DIR}; run `python -m harness nightly --out {out} "
                     "--part K/N` for each part first")
    files = [d / RESULTS_NAME for d in part_dirs]
    try:
        stored = read_selection(files[0])
    except ValueError as exc:  # StoredSelectionError
        return _fail(str(exc))
    if stored is None or stored.part is None:
        return _fail(f"{files[0]} is not a part's results (its selection file is missing or holds a whole run)")
    try:
        summary = reports.build(files, out)
    except ValueError as exc:  # parts of different partitions
        return _fail(str(exc))
    scope = summary.scope or {}
    problems = list(scope.get(PARTS_KEY) or [])
    nights = {d.name: read_json(d / NIGHTLY_NAME) for d in part_dirs}
    for name, night in sorted(nights.items()):
        label = name.replace("-of-", "/")
        if not night.get("finished") and not any(p.startswith(f"part {label} ") for p in problems):
            problems.append(f"part {label}'s nightly did not finish (its fuzz, performance or report): --resume it")
    not_run = "".join((d / NOT_RUN_NAME).read_text(encoding="utf-8") for d in part_dirs if (d / NOT_RUN_NAME).is_file())
    if not_run:
        (out / NOT_RUN_NAME).write_text(not_run, encoding="utf-8")
    else:
        (out / NOT_RUN_NAME).unlink(missing_ok=True)
    # A part's nightly.json keeps its part under "shard", the name since before "part" replaced it (and the
    # merged night its parts under "shards", "merged_shards"): earlier nights stay readable and comparable.
    first = next((n for n in nights.values() if (n.get("shard") or {}).get("index") == 0), {})
    state: dict[str, Any] = {
        "out": str(out), "complete": False, "merged_shards": True,
        "selection": {"id": stored.id, "options": stored.options},
        PARTS_KEY: {"count": stored.part["count"], "partition": stored.part["partition"],
                    "merged": [d.name for d in part_dirs], "problems": problems,
                    "unfinished_runs": sorted(name for name, n in nights.items() if not n.get("finished"))},
        "cases": {"selected": len(stored.case_ids), "not_run": len(not_run.splitlines()),
                  "world_sizes_skipped": {}},
        "verdicts": dict(summary.verdicts), "fuzz": first.get("fuzz") or {"skipped": "part 1 did not finish"},
        "perf": first.get("perf") or {"skipped": "part 1 did not finish"},
    }
    previous = config.previous if config.previous is not None else find_previous(out, stored.id)
    regressions = 0
    other = night_selection(previous) if previous is not None and previous.is_dir() else None
    if previous is None or (other is not None and other != stored.id):
        state["diff"] = {"previous": None, "note": f"no earlier nightly of this selection ({stored.id}) next to {out}"}
    else:
        result = reports.diff(baseline_source(previous), files)
        (out / DIFF_MD_NAME).write_text(render.diff_markdown(result, str(previous), str(out)), encoding="utf-8")
        write_json(out / DIFF_JSON_NAME, result.to_dict())
        regressions = len(result.regressions)
        state["diff"] = {"previous": str(previous), "counts": result.to_dict()["counts"]}
    code, reasons = exit_status(summary.verdicts, (state["fuzz"] or {}).get("exit_code"), regressions, False)
    if problems:
        code, reasons = max(code, 1), [*reasons, *problems]
    partial = partial_reasons(state)
    state.update(exit_code=code, exit_reasons=reasons, wall_s=round(time.monotonic() - start, 3), partial=partial,
                 complete=not problems and not partial, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_json(out / NIGHTLY_NAME, state)
    verdicts = ", ".join(f"{v} {n}" for v, n in summary.verdicts.items() if n) or "no case"
    print(f"{len(part_dirs)} of {stored.part['count']} parts merged: {summary.cases} cases ({verdicts})")
    print(f"nightly {'; '.join(reasons) if code else 'ok'} (exit {code}) -> {out}")
    return code
