"""What the suites of the CUDA-only engines we did not write (Megatron-FSDP, FairScale) share: the real run path
(``python -m harness run``) over an engine, its records read back, and their failures split into the declared
(strict expected failures, with their reasons) and the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.cases.records import FAILING

REPO = Path(__file__).resolve().parents[2]


def needs_package(missing: Callable[[], str | None]) -> pytest.MarkDecorator:
    """Skips a test that runs the engine for real where ``missing`` (the adapter's check) says its package is
    not installed, with the adapter's install line: a GPU host need not carry every engine we did not write."""
    reason = missing()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def run_records(out: Path, *args: str, timeout: float = 600) -> list[dict[str, Any]]:
    """``harness run --out OUT ARGS`` from the checkout (its ranks import this tree); the records it wrote."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--out", str(out), "--no-progress", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    # Exit 1 is a failing case, which the caller judges; anything else is the run's own failure.
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def undeclared_failures(records: list[dict[str, Any]], expected: Callable[[dict[str, Any]], str | None]) -> list[str]:
    """The failing records ``expected`` (record -> the engine bug's reason, or None) does not declare, and the
    declared ones that passed (a strict expected failure that passes means the bug is gone: say so)."""
    wrong = []
    for record in records:
        declared = expected(record)
        failing = record["verdict"] in FAILING
        if failing and declared is None:
            wrong.append(f"{record['case_id']}: {record['verdict']}: {record['reason'][:300]}")
        elif declared is not None and record["verdict"] == "pass":
            wrong.append(f"{record['case_id']}: passes, though declared an expected failure ({declared})")
    return wrong
