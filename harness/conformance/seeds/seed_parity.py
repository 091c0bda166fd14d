"""The seed files' training-parity checks, as harness cases on the plugin's pool for every engine with
torch FSDP1's API (``fsdp_api``), where ``--device`` places the ranks; the seed files' other checks run in
their rank sessions (a module of its own keeps pytest from interleaving these tests with a session's and
starting the session again).

- test_fsdp_core.py: parity with DDP of the nested, always-wrap nested, tied transformer and mixture of
  experts models (the engine suites' zoo models; the experts are rank-local, which DDP leaves out: the
  model's declared reduction), with and without CPU offload, over a Latin square of strategy x backward
  prefetch x use_orig_params x forward prefetch; each seed check is one test of its subtests.
- test_fsdp_use_orig_params.py: no_sync with original parameters against the all-data reference, per
  strategy.

The seed's checkpoint parity is ``test_fsdp_checkpoint.py``'s.
"""

from __future__ import annotations

import itertools

import pytest

from harness.case import FLAT_STRATEGIES, CaseConfig, engine_name
from harness.conformance.engine_models import ALWAYS_WRAP, MOE, NESTED, TRANSFORMER
from harness.fsdp1_api import no_shard_offload_race
from harness.pytest_plugin import ParityRunner, expect_failure
from harness.pytest_plugin.cases import ExpectedFailure, ParityOptions

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["test_seed_parity", "test_the_smoke_subtests_show_every_value_of_every_axis",
           "test_the_moe_offload_expectation_covers_torch_fsdp1_on_cuda_only", "test_no_sync_parity"]


def _subtests(model: str, offload: bool, smoke: bool = False) -> list[CaseConfig]:
    """Every strategy, each with every backward prefetch x use_orig_params value and forward prefetch
    alternating (a Latin square instead of the full product), against DDP. ``smoke`` (the CI lane) keeps
    one backward prefetch per strategy, each with both use_orig_params and forward prefetch values: every
    value of every axis, 6 subtests of 18."""
    return [
        CaseConfig(reference="ddp", model=model, sharding_strategy=strategy, cpu_offload=offload, backward_prefetch=bwd,
                   forward_prefetch=bool((i + j + offload) % 2), use_orig_params=orig)
        for i, strategy in enumerate(FLAT_STRATEGIES)
        for j, (bwd, orig) in enumerate(itertools.product(["none", "pre", "post"], [False, True]))
        if not smoke or j // 2 == i
    ]


#: The seed's parity checks, each a set of harness cases (the engine suites' zoo models; the mixture of
#: experts against DDP, which leaves its rank-local experts out: its declared reduction).
PARITY_CHECKS = {
    f"check_parity_{name}{'_offload' if offload else ''}": (model, offload)
    for name, model in (("nested_wrapped_model", NESTED), ("nested_always_wrap_model", ALWAYS_WRAP),
                        ("transformer", TRANSFORMER), ("mixture_of_experts", MOE))
    for offload in (False, True)
}

#: Measured on one H100 (torch 2.11, 2 gloo ranks sharing the GPU, 3 repetitions of the 18 subtests):
#: torch FSDP1 disagrees with the reference in most offload subtests of the mixture of experts, our
#: engine in none; without offload, and on the nested and transformer models with offload, both agree.
#: The experts are units over one-rank groups, which issue no collective; the likely cause (not yet
#: confirmed) is that nothing then orders the gradient's non-blocking copy to the host before the
#: optimizer step reads it, the race README's findings name for NO_SHARD with CPU offload on busy GPUs.
TORCH_FSDP1_MOE_OFFLOAD = ExpectedFailure(
    "torch FSDP1 with CPU offload on the experts' one-rank-group units disagrees with the reference on "
    "CUDA ranks (measured on an H100, gloo ranks sharing it); our engine agrees",
    lambda case, device: engine_name(case.engine) == "torch-fsdp" and device == "cuda" and case.model == MOE
    and case.cpu_offload,
)
#: how often an expected failure's subtests run: most subtests fail on a busy GPU, none did in one of
#: the runs on a lightly loaded one.
RACE_REPEATS = 3


@pytest.mark.parametrize("check", PARITY_CHECKS)
def test_seed_parity(fsdp_api: str, check: str, parity_runner: ParityRunner, parity_options: ParityOptions,
                     request: pytest.FixtureRequest) -> None:
    """One seed check: its subtests as harness cases on the plugin's pool (the smoke lane's selection
    there, every subtest in the others), failing if any fails."""
    model, offload = PARITY_CHECKS[check]
    cases = [case.replace(engine=fsdp_api) for case in _subtests(model, offload, smoke=parity_options.matrix == "smoke")]
    device = parity_runner.device_type(cases[0].world_size)
    if TORCH_FSDP1_MOE_OFFLOAD.applies(cases[0], device):
        # A race: one run of the subtests passed once on a lightly loaded GPU, so the strict expectation
        # gets every subtest, RACE_REPEATS times, to show it.
        cases = [case.replace(engine=fsdp_api) for case in _subtests(model, offload)] * RACE_REPEATS
        request.applymarker(expect_failure(TORCH_FSDP1_MOE_OFFLOAD.reason))
    else:
        cases = [case for case in cases if not _no_shard_offload_race(case, device)]
    parity_runner.run_all(cases)


def _no_shard_offload_race(case: CaseConfig, device: str) -> bool:
    return no_shard_offload_race(engine_name(case.engine), device, case.sharding_strategy, case.cpu_offload,
                                 case.use_orig_params)


def test_the_smoke_subtests_show_every_value_of_every_axis() -> None:
    smoke, every = _subtests(NESTED, False, smoke=True), _subtests(NESTED, False)
    assert len(smoke) == 6 and len(every) == 18 and set(smoke) <= set(every)
    for axis in ("sharding_strategy", "backward_prefetch", "use_orig_params", "forward_prefetch"):
        assert {getattr(c, axis) for c in smoke} == {getattr(c, axis) for c in every}, axis
    for strategy in FLAT_STRATEGIES:
        mine = [c for c in smoke if c.sharding_strategy == strategy]
        assert {c.use_orig_params for c in mine} == {c.forward_prefetch for c in mine} == {False, True}, strategy



def test_the_moe_offload_expectation_covers_torch_fsdp1_on_cuda_only() -> None:
    """The strict expectation applies to torch FSDP1's offload subtests of the mixture of experts on CUDA
    ranks, and to nothing our engine runs, on CPU ranks or without offload."""
    for check, (model, offload) in PARITY_CHECKS.items():
        for case in _subtests(model, offload):
            for engine, device in itertools.product(("torch-fsdp", "builtin"), ("cuda", "cpu")):
                expected = engine == "torch-fsdp" and device == "cuda" and check == "check_parity_mixture_of_experts_offload"
                assert TORCH_FSDP1_MOE_OFFLOAD.applies(case.replace(engine=engine), device) == expected, (check, engine, device)


NO_SYNC_CASES = [CaseConfig(reference="local", model=TRANSFORMER, sharding_strategy=strategy, use_orig_params=True,
                            grad_accum="no_sync") for strategy in FLAT_STRATEGIES]


@pytest.mark.parametrize("case", NO_SYNC_CASES, ids=lambda c: c.case_id)
def test_no_sync_parity(fsdp_api: str, case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(case.replace(engine=fsdp_api))
