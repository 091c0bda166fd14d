"""The pytest suites split over CI jobs by pytest-split (``--splits N --group K``): a group that drew no
test passes. pytest exits 5 ("no tests collected") when every test was deselected, which a CI matrix
reads as a failed job; that happens to a group when there are more groups than tests, or when the
selection (``-k``, ``-m``) leaves fewer. Exit status 5 stays where nothing was deselected (a path or
pattern that matches no test is still an error).

Loaded by the root ``conftest.py``; inert without pytest-split's ``--splits``.
"""

from __future__ import annotations

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus != pytest.ExitCode.NO_TESTS_COLLECTED or not session.config.getoption("splits", None):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    deselected = len(reporter.stats.get("deselected", ())) if reporter is not None else 0
    if deselected:
        if reporter is not None:
            reporter.write_line(f"split_groups: group {session.config.getoption('group')} of "
                                f"{session.config.getoption('splits')} drew no test ({deselected} deselected): "
                                "exit status 0, not 5")
        session.exitstatus = pytest.ExitCode.OK
