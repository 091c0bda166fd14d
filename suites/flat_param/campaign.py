"""Run the flat-parameter fuzz properties alone and report examples per second.

    python -m suites.flat_param.campaign [--profile nightly] [--max-examples N] [pytest args ...]

Runs ``test_fuzz_flat_param.py`` through ``pytest.main`` under a Hypothesis profile registered by
the root conftest.py (``nightly`` by default: at least 10,000 examples per property), then prints,
per property, the examples run (counted by the property bodies themselves, so shrinking and
replays count too), the seconds spent and examples per second. Unknown arguments go to pytest
(``-k ownership``, ``-x``, ``--hypothesis-seed 1``). The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tabulate import tabulate

# Hypothesis and the suite are imported inside the hooks, once pytest runs: imported earlier,
# pytest could not assertion-rewrite them (and warns).

FUZZ_MODULE = Path(__file__).with_name("test_fuzz_flat_param.py")


@dataclass
class PropertyRun:
    name: str
    examples: int
    seconds: float
    outcome: str

    @property
    def rate(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else float("nan")


@dataclass(eq=False)  # pytest keeps plugins in sets: identity hashing
class CampaignPlugin:
    """pytest plugin: applies ``--max-examples`` on top of the profile and times each property."""

    #: the Hypothesis profile the run was started with (--hypothesis-profile).
    profile: str
    #: overrides the profile's max_examples when not None.
    max_examples: int | None
    runs: list[PropertyRun] = field(default_factory=list)

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        # trylast: after Hypothesis's own plugin has loaded --hypothesis-profile.
        from hypothesis import settings

        if self.max_examples is not None:
            name = f"{self.profile}-campaign-{self.max_examples}"
            settings.register_profile(name, parent=settings.get_profile(self.profile), max_examples=self.max_examples)
            settings.load_profile(name)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        from suites.flat_param.support import EXAMPLES

        before = sum(EXAMPLES.values())
        start = time.perf_counter()
        outcome = yield
        seconds = time.perf_counter() - start
        status = "failed" if outcome.excinfo is not None else "passed"
        self.runs.append(PropertyRun(item.name, sum(EXAMPLES.values()) - before, seconds, status))


def report(runs: list[PropertyRun], profile: str) -> str:
    rows = [(r.name, r.outcome, r.examples, f"{r.seconds:.2f}", f"{r.rate:.1f}") for r in runs]
    examples = sum(r.examples for r in runs)
    seconds = sum(r.seconds for r in runs)
    rows.append(("total", "", examples, f"{seconds:.2f}", f"{examples / seconds:.1f}" if seconds else "nan"))
    table = tabulate(rows, headers=["property", "outcome", "examples", "seconds", "examples/s"], tablefmt="github")
    return f"flat-parameter fuzz campaign, profile {profile}\n{table}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m suites.flat_param.campaign", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", default="nightly", help="Hypothesis profile from the root conftest.py (ci, nightly, dev)"
    )
    parser.add_argument("--max-examples", type=int, default=None, help="examples per property, overriding the profile")
    args, pytest_args = parser.parse_known_args(argv)
    if args.max_examples is not None and args.max_examples < 1:
        parser.error(f"--max-examples={args.max_examples} must be at least 1")
    plugin = CampaignPlugin(args.profile, args.max_examples)
    status = pytest.main(
        [str(FUZZ_MODULE), "-q", "-p", "no:cacheprovider", f"--hypothesis-profile={args.profile}", *pytest_args],
        plugins=[plugin],
    )
    profile = args.profile if args.max_examples is None else f"{args.profile}, max_examples={args.max_examples}"
    print(report(plugin.runs, profile))
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
