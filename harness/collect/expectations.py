"""What an engine is known to get wrong: one type, :class:`ExpectedFailure`, for every suite that expects a
failure.

A generated suite's slice (``SuiteMatrix.expected_failures``), a ported check's subtests, the rank checks
(``api_rank_check_tests(expected_failures=...)``) and a test's own scenarios name theirs with it. The
pytest plugin makes one a strict xfail (``harness.pytest_plugin.expect_failure``: an unexpected pass fails
the run, so a fixed engine is noticed), and the records of its cases carry its reason
(``CaseRecord.expected_failure``), so a report tells a known bug from new breakage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from harness.cases.case import CaseConfig, engine_name

__all__ = ["ExpectedFailure", "expected_failure"]


@dataclass(frozen=True)
class ExpectedFailure:
    """A known engine bug and where it shows: every condition given must hold (none given: everywhere)."""

    #: why it fails: the xfail's reason and ``CaseRecord.expected_failure``.
    reason: str
    #: ``(case, device type of its ranks) -> bool``: the cases it covers; None: whatever the other
    #: conditions leave (a check's name holds no case).
    applies: Callable[[CaseConfig, str], bool] | None = None
    #: the engine it is a bug of, by name (``torch-fsdp``); None: any.
    engine: str | None = None
    #: the device type of the ranks it shows on (``cpu``, ``cuda``); None: any.
    device: str | None = None
    #: the checks it covers, by name (a rank check, a test's scenario); empty: any.
    checks: tuple[str, ...] = ()

    def covers(self, device: str, *, case: CaseConfig | None = None, engine: str | None = None,
               check: str | None = None) -> bool:
        """Whether it covers ``case`` (or the check ``check`` of ``engine``, a name or a spec) on ranks of
        the device type ``device``."""
        if engine is None and case is not None:
            engine = case.engine
        if self.engine is not None and (engine is None or engine_name(engine) != self.engine):
            return False
        if self.device is not None and device != self.device:
            return False
        if self.checks and check not in self.checks:
            return False
        return self.applies is None or (case is not None and self.applies(case, device))


def expected_failure(expectations: Iterable[ExpectedFailure], device: str, *, case: CaseConfig | None = None,
                     engine: str | None = None, check: str | None = None) -> ExpectedFailure | None:
    """The first of ``expectations`` that covers what ``ExpectedFailure.covers`` is asked of, if any."""
    return next((x for x in expectations if x.covers(device, case=case, engine=engine, check=check)), None)
