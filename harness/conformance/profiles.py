"""The Hypothesis profiles the properties run under (``ci``, ``nightly``, ``dev``), as a pytest plugin.

A plugin of the root ``conftest.py`` (every suite) and of the fuzz campaign, which runs from an
installed package where no conftest is found. At configure time it registers the profiles and loads
``FUZZ_PROFILE`` (default ``ci``); Hypothesis's own plugin configures after it, so
``--hypothesis-profile NAME`` wins over the variable.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["PROFILES", "pytest_configure", "register_profiles"]

PROFILES = ("ci", "nightly", "dev")


def register_profiles() -> None:
    """Register every profile of ``PROFILES`` with Hypothesis (again is harmless: same settings)."""
    # Imported here: imported before pytest has marked Hypothesis's plugin for assertion rewriting, it
    # could not be rewritten (and pytest warns); the campaign reads ``PROFILES`` before pytest starts.
    from hypothesis import HealthCheck, Phase, settings

    # ci: fast and derandomized, so a pull request sees the same examples every run.
    settings.register_profile(
        "ci",
        max_examples=300,
        derandomize=True,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    # nightly: a real search; failures print the blob that replays them with @reproduce_failure.
    settings.register_profile(
        "nightly",
        max_examples=10_000,
        deadline=None,
        print_blob=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import settings

    register_profiles()
    settings.load_profile(os.environ.get("FUZZ_PROFILE", "ci"))
