"""The nightly's fuzz phase: the flat-parameter campaign (``harness.conformance.fuzz_campaign``, shipped
in the package) in a child process, its share of a time budget, whether it runs alongside the cases, and its totals.

A nightly on GPUs leaves cores idle: the campaign (one CPU process) then runs alongside the cases
(``fuzz_alongside``); on CPU, where the ranks take every core, it runs after them. Either way a time
budget covers it: it gets what the budget has left when it starts, less ``REPORT_RESERVE_S`` for the
report (``fuzz_budget``), and caps its examples to fit (the campaign's ``--time-budget-s``); run after
the cases, it is left at least ``FUZZ_SHARE`` of the budget (``cases_deadline``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.ranks.placement import RESERVED_CORES, Lane

__all__ = ["FUZZ_SHARE", "REPORT_RESERVE_S", "FuzzOutcome", "FuzzRun", "cases_deadline", "fuzz_alongside", "fuzz_budget", "report_reserve", "parse_fuzz_totals", "run_fuzz"]

#: the directory holding the ``harness`` package (a checkout or site-packages), for the child's import path.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

#: seconds of a time budget kept for the report and the diff after the fuzz campaign.
REPORT_RESERVE_S = 30.0

#: the share of a budget (less the report's reserve) the cases leave to a fuzz campaign that runs after
#: them (on CPU): cases that would fill any budget must not leave the campaign nothing.
FUZZ_SHARE = 0.2


def report_reserve(time_budget_s: float) -> float:
    """Seconds of a budget kept for the report and the diff: ``REPORT_RESERVE_S``, or a quarter of a
    budget too short for it, so that the budget holds the report too."""
    return min(REPORT_RESERVE_S, time_budget_s / 4)


def cases_deadline(start: float, time_budget_s: float | None, fuzz_after: bool = False) -> float | None:
    """When the last case may start: the budget's end less the report's reserve and, when the fuzz
    campaign runs after the cases (``fuzz_after``), less its ``FUZZ_SHARE``; None without a budget."""
    if time_budget_s is None:
        return None
    usable = time_budget_s - report_reserve(time_budget_s)
    return start + usable * (1 - FUZZ_SHARE if fuzz_after else 1)


def fuzz_budget(time_budget_s: float | None, elapsed_s: float) -> float | None:
    """Seconds the fuzz campaign gets: what the budget has left after the cases, less
    ``report_reserve`` for the report; None without a budget (the profile's examples in full)."""
    if time_budget_s is None:
        return None
    return max(time_budget_s - elapsed_s - report_reserve(time_budget_s), 0.0)


_TOTAL_ROW = re.compile(r"^\|\s*total\s*\|[^|]*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+|nan)\s*\|", re.MULTILINE)


def parse_fuzz_totals(text: str) -> dict[str, float] | None:
    """``{"examples", "seconds", "examples_per_s"}`` from the campaign's table, None when it has none."""
    match = None
    for match in _TOTAL_ROW.finditer(text):
        pass  # the last table is the campaign's
    if match is None:
        return None
    return {"examples": int(match[1]), "seconds": float(match[2]), "examples_per_s": float(match[3])}


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
    #: seconds the time budget left it (None: no budget).
    time_budget_s: float | None = None


def fuzz_alongside(lanes: Mapping[int, Sequence[Lane]], cpu_cores: int) -> bool:
    """Whether the fuzz campaign (one CPU process) runs alongside the cases: when they run on GPUs (one per
    rank or shared) and
    the cores their ranks leave include ``RESERVED_CORES`` (the fuzz's among them). On CPU the ranks
    use every core, so the campaign runs after the cases."""
    groups = [lane for group in lanes.values() for lane in group]
    if not groups or any(lane.device == "cpu" for lane in groups):
        return False
    # World sizes run one after the other: the widest plan is what runs at once.
    busiest = max(sum(lane.world_size for lane in group) for group in lanes.values())
    return cpu_cores - busiest >= RESERVED_CORES


class FuzzRun:
    """The fuzz campaign in a child process, its output streamed into ``path`` (its progress bar on
    stderr with ``progress``); ``budget_s`` caps its time (``fuzz_budget``). ``start`` then ``wait``."""

    def __init__(self, profile: str, max_examples: int | None, path: Path, budget_s: float | None, progress: bool) -> None:
        self.outcome = FuzzOutcome(profile, max_examples, time_budget_s=budget_s)
        self.path = path
        self.cmd = [sys.executable, "-m", "harness.conformance.fuzz_campaign", "--profile", profile]
        if max_examples is not None:
            self.cmd += ["--max-examples", str(max_examples)]
        if budget_s is not None:
            self.cmd += ["--time-budget-s", f"{budget_s:.1f}"]
        self.progress = progress
        if progress:
            self.cmd += ["--progress"]
        self._proc: subprocess.Popen[bytes] | None = None
        self._file: Any = None
        self._start = 0.0

    def start(self) -> "FuzzRun":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU-only properties: no CUDA context next to the ranks
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write(f"$ {' '.join(self.cmd[1:])}\n")
        self._file.flush()
        self._start = time.monotonic()
        stderr = None if self.progress else subprocess.STDOUT  # the bar goes to the terminal
        self._proc = subprocess.Popen(self.cmd, env=env, stdout=self._file, stderr=stderr)
        return self

    def wait(self) -> FuzzOutcome:
        if self._proc is None:
            return self.outcome
        try:
            self.outcome.exit_code = self._proc.wait()
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._file.close()
        self.outcome.wall_s = time.monotonic() - self._start
        totals = parse_fuzz_totals(self.path.read_text(encoding="utf-8", errors="replace"))
        if totals is not None:
            self.outcome.examples = int(totals["examples"])
            self.outcome.examples_per_s = totals["examples_per_s"]
        return self.outcome

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def run_fuzz(profile: str, max_examples: int | None, path: Path, budget_s: float | None = None,
             progress: bool = False) -> FuzzOutcome:
    """Run the fuzz campaign to its end (``FuzzRun``)."""
    return FuzzRun(profile, max_examples, path, budget_s, progress).start().wait()
