"""Run the flat-parameter fuzz properties alone and report examples per second.

    python -m harness.conformance.fuzz_campaign [--profile nightly] [--max-examples N] [--time-budget-s S] [pytest args ...]

Runs ``flat_param_properties.py`` (beside this module, so an installed package runs it: no test tree
needed) through ``pytest.main`` under a Hypothesis profile of ``harness.conformance.profiles``
(``nightly`` by default: at least 10,000 examples per property), then prints,
per property, the examples run (counted by the property bodies themselves, so shrinking and
replays count too), the seconds spent and examples per second. Unknown arguments go to pytest
(``-k ownership``, ``-x``, ``--hypothesis-seed 1``). The exit status is pytest's.

With ``--time-budget-s`` each property gets an equal share of the time left when it starts: its
examples are capped at that share times the examples per second measured so far (a first guess of
``RATE_GUESS``, at most ``CALIBRATION_EXAMPLES``, before any property ran), and a property that starts after the budget is skipped. The
table says which properties were capped or skipped. ``--progress`` draws a bar over the properties on
stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tabulate import tabulate

from harness.conformance import profiles

# The properties are imported inside the hooks, once pytest runs: imported earlier, pytest could not
# assertion-rewrite them (and warns).

FUZZ_MODULE = Path(__file__).with_name("flat_param_properties.py")
#: examples per second assumed before the first property measured it (measured ~100 on one CPU core) ...
RATE_GUESS = 100.0
#: ... and the most examples a property gets on that guess alone (a loaded host runs far fewer per second).
CALIBRATION_EXAMPLES = 200
#: fewest examples a capped property still runs: fewer says nothing.
MIN_EXAMPLES = 20


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
    #: ``time.monotonic()`` after which no property starts; None: no budget.
    deadline: float | None = None
    #: draw a progress bar over the properties on stderr.
    progress: bool = False
    #: properties whose examples the budget capped, with the cap.
    capped: dict[str, int] = field(default_factory=dict)
    #: properties the budget left out.
    skipped: list[str] = field(default_factory=list)
    _total: int = 0
    _bar: object = None

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self._total = len(items)
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=self._total, unit="property", desc="fuzz", file=sys.stderr, dynamic_ncols=True)

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        if self._bar is not None:
            self._bar.update(1)  # type: ignore[attr-defined]

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._bar is not None:
            self._bar.close()  # type: ignore[attr-defined]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.deadline is None:
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.skipped.append(item.name)
            pytest.skip(reason="fuzz time budget spent")
        from hypothesis import settings

        examples, seconds = sum(r.examples for r in self.runs), sum(r.seconds for r in self.runs)
        rate = examples / seconds if examples and seconds > 0 else RATE_GUESS
        properties_left = max(self._total - len(self.runs) - len(self.skipped), 1)
        cap = max(MIN_EXAMPLES, int(rate * left / properties_left))
        if not examples:
            cap = min(cap, CALIBRATION_EXAMPLES)
        if cap < settings.default.max_examples:
            # Applied once per property (this process runs each once): @settings over @given.
            settings(settings.default, max_examples=cap)(item.obj)  # type: ignore[attr-defined]
            self.capped[item.name] = cap

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
        from harness.conformance.flat_param_properties import EXAMPLES

        before = sum(EXAMPLES.values())
        start = time.perf_counter()
        outcome = yield
        seconds = time.perf_counter() - start
        status = "failed" if outcome.excinfo is not None else "passed"
        self.runs.append(PropertyRun(item.name, sum(EXAMPLES.values()) - before, seconds, status))


def report(runs: list[PropertyRun], profile: str, capped: dict[str, int] | None = None, skipped: list[str] | None = None) -> str:
    rows = [(r.name, r.outcome, r.examples, f"{r.seconds:.2f}", f"{r.rate:.1f}") for r in runs]
    examples = sum(r.examples for r in runs)
    seconds = sum(r.seconds for r in runs)
    rows.append(("total", "", examples, f"{seconds:.2f}", f"{examples / seconds:.1f}" if seconds else "nan"))
    table = tabulate(rows, headers=["property", "outcome", "examples", "seconds", "examples/s"], tablefmt="github")
    lines = [f"flat-parameter fuzz campaign, profile {profile}", table]
    if capped:
        lines.append("capped by the time budget: " + ", ".join(f"{n} at {k} examples" for n, k in capped.items()))
    if skipped:
        lines.append("skipped, time budget spent: " + ", ".join(skipped))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.conformance.fuzz_campaign", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="nightly", choices=profiles.PROFILES, help="Hypothesis profile (harness.conformance.profiles)")
    parser.add_argument("--max-examples", type=int, default=None, help="examples per property, overriding the profile")
    parser.add_argument("--time-budget-s", type=float, default=None, help="cap the examples so the campaign ends in about this time")
    parser.add_argument("--progress", action="store_true", help="a progress bar over the properties on stderr")
    args, pytest_args = parser.parse_known_args(argv)
    if args.max_examples is not None and args.max_examples < 1:
        parser.error(f"--max-examples={args.max_examples} must be at least 1")
    if args.time_budget_s is not None and args.time_budget_s < 0:
        parser.error(f"--time-budget-s={args.time_budget_s} must not be negative")
    deadline = time.monotonic() + args.time_budget_s if args.time_budget_s is not None else None
    plugin = CampaignPlugin(args.profile, args.max_examples, deadline=deadline, progress=args.progress)
    status = pytest.main(
        [str(FUZZ_MODULE), "-q", "-p", "no:cacheprovider", f"--hypothesis-profile={args.profile}", *pytest_args],
        plugins=[profiles, plugin],
    )
    profile = args.profile if args.max_examples is None else f"{args.profile}, max_examples={args.max_examples}"
    print(report(plugin.runs, profile, plugin.capped, plugin.skipped))
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
