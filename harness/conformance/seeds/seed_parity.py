"""The ported files' training-parity checks, as harness cases on the plugin's pool for every engine with
torch FSDP1's API (``fsdp_api``), where ``--device`` places the ranks; the ported files' other checks run as
their rank checks (a module of its own keeps pytest from interleaving these tests with a module's rank checks
and starting those ranks again).

- test_fsdp_core.py: parity with DDP of the nested, always-wrap nested, tied transformer and mixture of
  experts models (the engine suites' zoo models; the experts are rank-local, which DDP leaves out: the
  model's declared reduction), with and without CPU offload, over the ported test's product of strategy x backward
  prefetch x forward prefetch x use_orig_params x init mode (the init modes on CUDA ranks, where they
  differ); each ported check is one test of its subtests. The CI tier (``--matrix smoke``) runs 6 of them
  that show every value of every axis; ``--matrix pairwise|full`` (the slow tiers) and the GPU runs with
  them run the whole product.
- test_fsdp_use_orig_params.py: no_sync with original parameters against the all-data reference, per
  strategy.

The ported test's checkpoint parity is ``test_fsdp_checkpoint.py``'s.
"""

from __future__ import annotations

import itertools

import pytest

from harness.cases.case import FLAT_STRATEGIES, CaseConfig, engine_name
from harness.collect.expectations import ExpectedFailure
from harness.conformance.engine_models import ALWAYS_WRAP, MOE, NESTED, TRANSFORMER
from harness.engines.fsdp1_api import no_shard_offload_race
from harness.pytest_plugin import ParityRunner, expect_failure
from harness.pytest_plugin.cases import ParityOptions

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["test_seed_parity", "test_the_subtests_are_the_torch_tests_product_and_smoke_shows_every_value",
           "test_the_moe_offload_expectation_covers_torch_fsdp1_on_cuda_only", "test_no_sync_parity"]


#: The ported test's init modes (its ``CUDAInitMode``) as the harness's ``init_mode``: CUDA_BEFORE and
#: CUDA_AFTER, and CUDA_NEVER with offload only, as the ported test runs them. CUDA_AFTER with offload is the
#: ported test's expected error (a module moved to the GPU after offload wrapping; the harness's invalid
#: ``offload_after_wrap``, whose error suites/engine/test_gpu_placement.py checks on both engines). On CPU ranks
#: every mode builds the same model (nothing moves), so there ``before`` stands for them all.
def init_modes(offload: bool, device: str) -> list[str]:
    if device != "cuda":
        return ["before"]
    return ["before", "never"] if offload else ["before", "after"]


def ported_subtests(model: str, offload: bool, smoke: bool = False, device: str = "cpu") -> list[CaseConfig]:
    """The ported test's subtests against DDP: every strategy x backward prefetch x forward prefetch x
    use_orig_params x init mode (``init_modes``). ``smoke`` (the CI tier) keeps, per strategy, one backward
    prefetch with both use_orig_params values, forward prefetch alternating and the init modes taking turns:
    every value of every axis in 6 subtests."""
    modes = init_modes(offload, device)
    every = itertools.product(FLAT_STRATEGIES, ["none", "pre", "post"], [False, True], [False, True], modes)
    cases = [CaseConfig(reference="ddp", model=model, sharding_strategy=strategy, cpu_offload=offload, backward_prefetch=bwd,
                        forward_prefetch=fwd, use_orig_params=orig, init_mode=init)
             for strategy, bwd, fwd, orig, init in every]
    if not smoke:
        return cases
    kept = []
    for i, strategy in enumerate(FLAT_STRATEGIES):
        for orig in (False, True):
            k = 2 * i + orig
            want = dict(sharding_strategy=strategy, backward_prefetch=["none", "pre", "post"][i], use_orig_params=orig,
                        forward_prefetch=bool((k + offload) % 2), init_mode=modes[k % len(modes)])
            kept += [c for c in cases if all(getattr(c, axis) == value for axis, value in want.items())]
    return kept


#: The ported test's parity checks, each a set of harness cases (the engine suites' zoo models; the mixture of
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
#: optimizer step reads it, the race docs/gpus.md's known torch bugs name for NO_SHARD with CPU offload on busy GPUs.
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
    """One ported check: its subtests as harness cases on the plugin's pool (the smoke tier's selection
    there, every subtest in the others: ``--matrix pairwise|full``), failing if any fails."""
    model, offload = PARITY_CHECKS[check]
    device = parity_runner.device_type(CaseConfig().world_size)
    cases = [case.replace(engine=fsdp_api)
             for case in ported_subtests(model, offload, smoke=parity_options.matrix == "smoke", device=device)]
    if TORCH_FSDP1_MOE_OFFLOAD.covers(device, case=cases[0]):
        # A race: one run of the subtests passed once on a lightly loaded GPU, so the strict expectation
        # gets every subtest, RACE_REPEATS times, to show it.
        cases = [case.replace(engine=fsdp_api) for case in ported_subtests(model, offload, device=device)] * RACE_REPEATS
        request.applymarker(expect_failure(TORCH_FSDP1_MOE_OFFLOAD))
    else:
        cases = [case for case in cases if not _no_shard_offload_race(case, device)]
    parity_runner.run_all(cases)


def _no_shard_offload_race(case: CaseConfig, device: str) -> bool:
    return no_shard_offload_race(engine_name(case.engine), device, case.sharding_strategy, case.cpu_offload,
                                 case.use_orig_params)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_the_subtests_are_the_torch_tests_product_and_smoke_shows_every_value(device: str, offload: bool) -> None:
    smoke, every = ported_subtests(NESTED, offload, smoke=True, device=device), ported_subtests(NESTED, offload, device=device)
    modes = init_modes(offload, device)
    assert len(every) == 36 * len(modes) == len(set(every)), "strategy x bwd x fwd x orig x init mode, each once"
    assert len(smoke) == 6 and set(smoke) <= set(every)
    axes = ("sharding_strategy", "backward_prefetch", "use_orig_params", "forward_prefetch", "init_mode")
    for axis in axes:
        assert {getattr(c, axis) for c in smoke} == {getattr(c, axis) for c in every}, axis
    assert {c.init_mode for c in every} == set(modes) and ("after" in modes) == (device == "cuda" and not offload)
    for strategy in FLAT_STRATEGIES:
        mine = [c for c in smoke if c.sharding_strategy == strategy]
        assert {c.use_orig_params for c in mine} == {c.forward_prefetch for c in mine} == {False, True}, strategy


def test_the_moe_offload_expectation_covers_torch_fsdp1_on_cuda_only() -> None:
    """The strict expectation applies to torch FSDP1's offload subtests of the mixture of experts on CUDA
    ranks, and to nothing our engine runs, on CPU ranks or without offload."""
    for check, (model, offload) in PARITY_CHECKS.items():
        for case in ported_subtests(model, offload, device="cuda"):
            for engine, device in itertools.product(("torch-fsdp", "builtin"), ("cuda", "cpu")):
                expected = engine == "torch-fsdp" and device == "cuda" and check == "check_parity_mixture_of_experts_offload"
                assert TORCH_FSDP1_MOE_OFFLOAD.applies(case.replace(engine=engine), device) == expected, (check, engine, device)


NO_SYNC_CASES = [CaseConfig(reference="local", model=TRANSFORMER, sharding_strategy=strategy, use_orig_params=True,
                            grad_accum="no_sync") for strategy in FLAT_STRATEGIES]


@pytest.mark.parametrize("case", NO_SYNC_CASES, ids=lambda c: c.case_id)
def test_no_sync_parity(fsdp_api: str, case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(case.replace(engine=fsdp_api))
