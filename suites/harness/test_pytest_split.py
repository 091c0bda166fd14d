"""The suites split over CI jobs with pytest-split (``--splits N --group K``, docs/testing.md "Splitting the
pytest suites"): the groups are disjoint and cover the suite, its default algorithm (``duration_based_chunks``)
cuts the collection order into contiguous runs, so at most N - 1 modules are split (their rank checks
then run in two groups), and a group that drew no test passes (``harness.pytest_plugin.split_groups``)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_split", reason="pytest-split not installed (pip install -e '.[ci]')")

#: three modules of two tests each.
MODULES = {f"test_{m}": "def test_one():\n    pass\n\ndef test_two():\n    pass\n" for m in "abc"}
PLUGIN = ("-p", "harness.pytest_plugin.split_groups", "-p", "no:cacheprovider")


def _group(pytester: pytest.Pytester, splits: int, group: int) -> list[str]:
    result = pytester.runpytest_inprocess("--collect-only", "-q", *PLUGIN, "--splits", str(splits), "--group", str(group))
    return [line for line in result.outlines if "::" in line]


def test_groups_cover_the_suite_once_and_split_few_modules(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**MODULES)
    splits = 2
    groups = [_group(pytester, splits, k) for k in range(1, splits + 1)]
    ran = [test for group in groups for test in group]
    assert sorted(ran) == sorted(f"{m}.py::test_{t}" for m in MODULES for t in ("one", "two"))
    modules_in = [{test.split("::")[0] for test in group} for group in groups]
    split = [m for m in MODULES if sum(f"{m}.py" in group for group in modules_in) > 1]
    assert len(split) <= splits - 1, modules_in


def test_an_empty_group_passes_and_an_empty_suite_still_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**MODULES)
    empty = pytester.runpytest_inprocess(*PLUGIN, "--splits", "8", "--group", "8")  # 6 tests, 8 groups
    assert empty.ret == pytest.ExitCode.OK and "drew no test" in empty.stdout.str(), empty.stdout.str()
    unsplit = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--splits", "8", "--group", "8")
    assert unsplit.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # pytest-split alone: what the plugin changes
    pytester.mkdir("no_tests")  # nothing collected, nothing deselected: a wrong path stays an error
    nothing = pytester.runpytest_inprocess(*PLUGIN, "--splits", "2", "--group", "1", "no_tests")
    assert nothing.ret == pytest.ExitCode.NO_TESTS_COLLECTED
