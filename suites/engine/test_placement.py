"""CPU offload placement on the CPU tier: the recorder of ``harness.compare.param_devices`` and its offload rule
(pure, over planted records), one offloaded training step of our engine on 2 gloo ranks for every
strategy and ``use_orig_params`` (every point recorded, nothing off the promised device: the CPU
is also the compute device here), and the refusal of a module moved off the CPU after wrapping.

The side-by-side comparison with torch FSDP1 needs an accelerator (torch pins offloaded memory):
suites/engine/test_gpu_placement.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.unit import offloaded_placement_error
from harness.compare.param_devices import COMPUTE_POINTS, PARAMETER_POINTS, Violation, offload_violations, original_names
from harness.conformance.engine_models import NestedWrapped
from harness.conformance.fsdp1_checks import load_api
from harness.pytest_plugin.rank_checks import rank_check_tests
from suites.engine.placement import configurations, offload_step

CPU = torch.device("cpu")
CPU_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")  # hybrid default groups need GPUs


def _clean_log(names: list[str]) -> dict:
    log = {point: {n: ("cpu", "cpu") for n in names} for point in PARAMETER_POINTS}
    log["in_summon"] = {n: ("cuda:0", None) for n in names}
    log["in_no_sync"] = {n: ("cpu", "cuda:0") for n in names}
    for point in COMPUTE_POINTS:
        log[point] = {n: ("cuda:0", None) for n in names}
    return log


def test_offload_rule_accepts_a_step_that_keeps_its_promises() -> None:
    assert offload_violations(_clean_log(["a.weight", "b.bias"]), "cuda") == []


@pytest.mark.parametrize(
    "point, entry, what",
    [
        ("after_step", ("cuda:0", "cpu"), "parameter"),
        ("after_backward", ("cpu", "cuda:0"), "gradient"),
        ("in_summon", ("cpu", None), "parameter"),
        ("forward", ("cpu", None), "parameter"),
        ("in_summon_offload_to_cpu", ("cuda:0", None), "parameter"),
    ],
)
def test_offload_rule_names_a_planted_misplacement(point: str, entry: tuple, what: str) -> None:
    log = _clean_log(["a.weight", "b.bias"])
    log[point]["b.bias"] = entry
    found = offload_violations(log, "cuda")
    assert len(found) == 1 and (found[0].point, found[0].name, found[0].what) == (point, "b.bias", what), found
    assert "b.bias" in str(found[0]) and point in str(found[0])


def test_original_names_lists_tied_parameters_under_each_name() -> None:
    from harness.conformance.engine_models import SharedTransformer

    names = original_names(SharedTransformer())
    assert "embed.weight" in names and "proj.weight" in names


def test_offload_placement_error_names_the_module_and_the_device() -> None:
    # The real move (``model.to("cuda")`` after wrapping) runs in suites/engine/test_gpu_placement.py;
    # here the rule alone, for a shard found on an accelerator and on the CPU.
    error = offloaded_placement_error(True, torch.device("cuda", 1), "NestedWrapped", torch.device("cuda", 1))
    assert error is not None
    assert "An FSDP-managed module with parameter CPU offloading enabled has parameters on cuda:1" in error
    assert "NestedWrapped" in error
    assert offloaded_placement_error(True, CPU, "NestedWrapped", torch.device("cuda", 1)) is None
    assert offloaded_placement_error(False, torch.device("cuda", 1), "NestedWrapped", torch.device("cuda", 1)) is None


def check_offloaded_step_placement(rank: int, world_size: int) -> None:
    api = load_api("builtin")
    for model_name, strategy, orig in configurations(CPU_STRATEGIES):
        log = offload_step(api, model_name, strategy, orig, CPU)
        where = f"{model_name} {strategy} use_orig_params={orig}"
        wanted = set(PARAMETER_POINTS) | set(COMPUTE_POINTS)
        if strategy == "NO_SHARD":
            wanted -= {"in_summon_offload_to_cpu", "after_summon_offload_to_cpu"}
        assert set(log) == wanted, (where, sorted(set(log) ^ wanted))
        names = set(original_names(NestedWrapped() if model_name == "engine_nested" else _transformer()))
        for point in COMPUTE_POINTS:
            assert set(log[point]) == names, (where, point, sorted(names ^ set(log[point])))
        violations: list[Violation] = offload_violations(log, "cpu")
        assert not violations, (where, [str(v) for v in violations])
        # Gradients exist after backward (and stay through the step): the record is not vacuous.
        assert any(g is not None for _, g in log["after_backward"].values()), where


def _transformer() -> nn.Module:
    from harness.conformance.engine_models import SharedTransformer

    return SharedTransformer()


CHECKS = [check_offloaded_step_placement]
rank_checks, test_check = rank_check_tests(CHECKS)
