"""Results files for the report suites, written with the real collector."""

from __future__ import annotations

from pathlib import Path

from synthetic_records import RUN

from harness.cases.records import CaseRecord
from harness.collect.collector import ResultWriter


def write_results(path: Path, records: list[CaseRecord]) -> Path:
    with ResultWriter(path, RUN) as writer:
        for r in records:
            writer.append(r)
    return path
