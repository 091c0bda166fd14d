"""Flat-parameter metadata of every selected FSDP1-API engine that exposes a ``FlatParamHandle``,
against torch FSDP1's layout on the same module.

``fsdp_api`` (``harness.pytest_plugin``) runs this once per engine ``--engine`` selects; an engine whose
namespace has no ``FlatParamHandle`` (``harness.engines.fsdp1_api``) is skipped with that reason, an engine without
torch FSDP1 to compare with likewise. The comparison is the fuzz properties' differential one
(metadata, the shard's real elements bitwise, the module's attributes), on fewer examples. It is what
``python -m harness certify`` reports as the ``flat-param`` family, run there as
``pytest --pyargs harness.conformance.engine_layout -p harness.pytest_plugin --engine SPEC`` (from an
installed package too); the CI tier collects it through ``suites/flat_param/test_engine_layout.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from harness.conformance.flat_cases import FlatCase, flat_cases
from harness.conformance.flat_handles import Registrations
from harness.conformance.flat_param_properties import ALL_STRATEGIES, handle_states, torch_flat_param
from harness.engines.fsdp1_api import FSDPApi, load_api

#: what a collector of this check imports: the test, its fixture and its marks.
__all__ = ["handle_api", "pytestmark", "test_layout_matches_torch_fsdp1"]

pytestmark = [pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")]


@pytest.fixture(scope="module")
def handle_api(fsdp_api: str) -> FSDPApi:
    if torch_flat_param is None:
        pytest.skip(reason="torch built without distributed: no FSDP1 layout to compare with")
    api = load_api(fsdp_api)
    if api.FlatParamHandle is None or api.HandleShardingStrategy is None:
        pytest.skip(reason=f"{api.name}: {api.module} exposes no FlatParamHandle/HandleShardingStrategy "
                           "(package level, .flat_param or ._flat_param)")
    return api


@settings(max_examples=40, deadline=None)
@given(case=flat_cases(shardings=ALL_STRATEGIES))
def test_layout_matches_torch_fsdp1(handle_api: FSDPApi, case: FlatCase) -> None:
    module = case.build()
    registrations = Registrations(module)
    ours = handle_states(case, handle_api.FlatParamHandle, handle_api.HandleShardingStrategy, module, registrations)
    theirs = handle_states(case, torch_flat_param.FlatParamHandle, torch_flat_param.HandleShardingStrategy, module, registrations)
    for phase, mine, ref in zip(("constructed", "sharded"), ours, theirs):
        assert mine.keys() == ref.keys()
        for key in mine:
            assert mine[key] == ref[key], f"{handle_api.name}, {phase}: {key} differs from torch FSDP1's layout"
