"""Fixtures of the seed conformance suites: the FSDP1 API of the engine under test.

``fsdp_api`` (the engine name) is parametrized by ``harness.pytest_plugin`` over the engines with
torch FSDP1's API that ``--engine`` names; ``api`` loads that engine's names.
"""

from __future__ import annotations

import pytest

from suites.seeds.api import FSDPApi, load_api


@pytest.fixture(scope="module")
def api(fsdp_api: str) -> FSDPApi:
    """The names of the engine under test (``FSDP``, enums, wrap policies, flat-parameter handle)."""
    return load_api(fsdp_api)
