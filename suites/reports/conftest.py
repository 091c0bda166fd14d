"""Fixtures of the report suites: synthetic results files written with the real collector."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_files import write_results
from synthetic_records import mixed_records


@pytest.fixture
def mixed_results(tmp_path: Path) -> Path:
    return write_results(tmp_path / "results.jsonl", mixed_records())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, "reports.Summary"]:
    """One report of the mixed records, shared by the tests that only read it: (results, out, summary)."""
    import reports

    tmp = tmp_path_factory.mktemp("built")
    results = write_results(tmp / "results.jsonl", mixed_records())
    return results, tmp / "out", reports.build(results, tmp / "out")


@pytest.fixture
def small_results(tmp_path: Path) -> Path:
    """A results file of one engine (one heatmap): cheap to build again in a test."""
    return write_results(tmp_path / "small.jsonl", [r for r in mixed_records() if r.case["engine"] == "builtin"])
