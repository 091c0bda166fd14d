"""The helpers the ported checks share, per engine (``FSDPApi``, ``harness.engines.fsdp1_api``), and the ``api``
fixture that loads the engine under test.

The ported suites are conformance tests: every check takes an ``FSDPApi`` first and uses only its names,
so the same check runs on every engine with torch FSDP1's API that ``--engine`` selects; what the names
are and the documented differences between engines are ``harness.engines.fsdp1_api``'s.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.case import CaseConfig
from harness.cases.model_protocol import ZooModel, to_device
from harness.compare.compare import assert_tensors_match
from harness.compare.tolerance import TolerancePolicy
from harness.engines.fsdp1_api import FSDPApi, load_api
from harness.engines.optim import sgd
from harness.engines.references import LocalReference, all_rank_batch

#: the ported checks take both from here, with the helpers below.
__all__ = ["FSDPApi", "api", "load_api"]


@pytest.fixture(scope="module")
def api(fsdp_api: str) -> FSDPApi:
    """The names of the engine under test (``FSDP``, enums, wrap policies, flat-parameter handle), for the
    checks and for decisions the test process makes (offload skips). ``fsdp_api`` (the engine name) is
    parametrized by ``harness.pytest_plugin`` over the engines with torch FSDP1's API that ``--engine``
    names."""
    return load_api(fsdp_api)

# ---------------------------------------------------------------------------------------------------
# Comparison helpers, engine-neutral: what checks that are not harness cases compare with (training
# parity itself is harness cases, ``harness.pytest_plugin``'s ``parity_runner``)

LR = 0.05
MOMENTUM = 0.9


def optim(params: Any) -> torch.optim.Optimizer:
    """The harness's parity optimizer (``harness.engines.optim.sgd``) at the ported checks' ``LR`` and ``MOMENTUM``."""
    return sgd(params, LR, MOMENTUM)


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full_params(api: FSDPApi, model: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's full parameters by clean name (cloned inside summon_full_params)."""
    with api.FSDP.summon_full_params(model):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def assert_match(name: str, actual: torch.Tensor, expected: torch.Tensor, context: str) -> None:
    """``actual`` against ``expected`` under the harness's tolerance for their dtype (torch's defaults:
    what a full-precision generated case at two ranks is held to), failing with the harness's message."""
    assert_tensors_match(name, actual, expected, TolerancePolicy.for_dtype(expected.dtype), context)


def assert_params_match(api: FSDPApi, model: nn.Module, ref: nn.Module, context: str) -> None:
    got = full_params(api, model)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert sorted(got) == sorted(want), f"{context}: parameter names differ: {sorted(got)} vs {sorted(want)}"
    for name in want:
        assert_match(f"param:{name}", got[name].to(want[name].device), want[name], context)


def all_data(cls: Any, step: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every rank's batch of engine model ``cls`` at ``step``, for the local reference (``harness.engines.references``)."""
    return all_rank_batch(lambda s, r: cls.get_input(step=s, rank=r), step, world, device)


def assert_matches_local_reference(api: FSDPApi, model: nn.Module, case: CaseConfig, context: str) -> None:
    """The wrapped model's full parameters, after a check trained it the case's way by hand (where the
    harness cannot build or train it: auto-wrap policies, injected delays), against what the harness's
    local reference computes for ``case`` (``harness.engines.references.LocalReference``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    want = LocalReference.for_case(case, case.precision_spec, device, world).run(rank).params
    got = full_params(api, model)
    assert sorted(got) == sorted(want), f"{context}: parameter names differ: {sorted(got)} vs {sorted(want)}"
    for name in want:
        # The reference's parameters come flattened, as the harness compares them.
        assert_match(f"param:{name}", got[name].to(want[name].device).reshape(want[name].shape), want[name], context)



def assert_trains_like_local_reference(api: FSDPApi, model: nn.Module, zoo: ZooModel, case: CaseConfig,
                                       device: torch.device, context: str) -> None:
    """Train ``model`` (``zoo`` wrapped by a check, as the harness cannot: an auto-wrap policy, the torch test's
    init modes) the case's way by hand, SGD over ``zoo``'s batches and loss for ``case.steps`` steps with
    inputs on ``device``, then compare it with the harness's local reference
    (``assert_matches_local_reference``)."""
    rank = dist.get_rank()
    opt = sgd(model.parameters(), case.lr, case.momentum)
    for step in range(case.steps):
        inputs = to_device(zoo.get_input(seed=case.seed, step=step, rank=rank), device)
        zoo.get_loss(inputs, model(*inputs)).backward()
        opt.step()
        opt.zero_grad()
    assert_matches_local_reference(api, model, case, context)

Check = Callable[[FSDPApi, int, int], None]
