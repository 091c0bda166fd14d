"""The ``offload_placement`` knob check: every engine's parameters and gradients where CPU offload
promises them, from the probe of ``harness.compare.offload_probe``.

On CPU: the check's rule over planted records (status and message), and offload cases on the parity
pool, where the probe runs for our engine and FSDP2 with the utilities each has (the check is n/a
there: the ranks compute on CPU). On GPUs: the matrix's offload cases of our engine, torch FSDP1 and
a planted engine (``stray_engine``: ours, leaving one parameter on the GPU) at world size 1, and 2
where there are 2 GPUs; ours and torch's pass the check, the planted engine fails it, naming the
parameter and its device::

    PYTHONPATH=. python3 -m pytest suites/harness/test_offload_placement.py -m gpu -q
"""

from __future__ import annotations

import pytest
from stray_engine import NAME, run_case_with_stray_engine, stray_parameter

from harness.cases.case import CaseConfig
from harness.cases.models import build_model
from harness.cases.records import CaseRecord
from harness.compare.knobs import check_offload_placement
from harness.compare.param_devices import COMPUTE_POINTS, PARAMETER_POINTS, PlacementLog
from harness.compare.parity import record_from_outcome
from harness.pytest_plugin import needs_gpus
from harness.pytest_plugin.pools import rank_pool_fixture
from harness.ranks.pool import RankPool
from harness.selection.matrix import generate

# ---------------------------------------------------------------------------------------------------
# The rule (pure)


def _kept_promises(names: list[str], points: tuple[str, ...] = (*PARAMETER_POINTS, *COMPUTE_POINTS)) -> PlacementLog:
    """A record of a step that keeps every promise of offload, computing on cuda:0."""
    on_device = {"in_summon", *COMPUTE_POINTS}
    return {p: {n: ("cuda:0", None) if p in on_device else ("cpu", "cpu") for n in names} for p in points}


def test_a_step_that_keeps_the_promises_is_ok() -> None:
    check = check_offload_placement(_kept_promises(["a.weight", "b.bias"]), "cuda")
    assert (check.knob, check.status) == ("offload_placement", "ok"), check
    assert "24 placements at 12 points" in check.reason and "not recorded" not in check.reason


@pytest.mark.parametrize("point, entry, found", [
    ("after_construction", ("cuda:0", None), "parameter b.bias at after_construction: on cuda:0, expected cpu"),
    ("after_step", ("cpu", "cuda:1"), "gradient b.bias at after_step: on cuda:1, expected cpu"),
    ("forward", ("cpu", None), "parameter b.bias at forward: on cpu, expected cuda"),
])
def test_a_misplaced_parameter_fails_naming_it_the_point_and_the_device(point: str, entry: tuple, found: str) -> None:
    log = _kept_promises(["a.weight", "b.bias"])
    log[point]["b.bias"] = entry
    check = check_offload_placement(log, "cuda")
    assert check.status == "ignored", check
    assert check.reason == f"cpu_offload=True: {found}"


def test_many_misplacements_are_counted_after_the_first_three() -> None:
    log = _kept_promises(["a.weight", "b.bias"])
    for point in ("after_construction", "after_backward", "after_step", "after_summon"):
        log[point]["a.weight"] = ("cuda:0", "cpu")
    check = check_offload_placement(log, "cuda")
    assert check.status == "ignored" and check.reason.endswith("(+1 more)"), check
    assert check.reason.count("a.weight") == 3


def test_cpu_ranks_say_n_a_but_still_fail_a_device_that_is_not_the_cpu() -> None:
    log = {p: {n: ("cpu", "cpu") for n in ["w"]} for p in ("after_construction", "forward", "after_step")}
    check = check_offload_placement(log, "cpu")
    assert check.status == "n/a" and "compute on CPU" in check.reason, check
    log["after_step"]["w"] = ("meta", None)
    assert check_offload_placement(log, "cpu").status == "ignored"


def test_utilities_an_engine_lacks_are_reported_not_passed() -> None:
    points = ("after_construction", "forward", "after_forward", "backward", "after_backward", "after_step")
    missing = {"summon": "fully_shard has no summon_full_params", "summon_offload_to_cpu": "fully_shard has no summon_full_params",
               "no_sync": "fully_shard has no no_sync"}
    check = check_offload_placement(_kept_promises(["w"], points), "cuda", missing)
    assert check.status == "ok", check
    assert "summon, summon_offload_to_cpu not observed: fully_shard has no summon_full_params" in check.reason
    assert "no_sync not observed: fully_shard has no no_sync" in check.reason
    assert "not recorded" not in check.reason


def test_points_never_reached_are_named() -> None:
    # An engine whose modules never run their forward through nn.Module.__call__: no compute point.
    check = check_offload_placement(_kept_promises(["w"], PARAMETER_POINTS), "cuda")
    assert check.status == "ok" and "not recorded: forward, backward" in check.reason, check
    assert check_offload_placement({}, "cuda").status == "n/a"


# ---------------------------------------------------------------------------------------------------
# The probe on the parity pool (gloo on CPU; NCCL where there are 2 GPUs)


def _run(pool: RankPool, case: CaseConfig) -> CaseRecord:
    return record_from_outcome(case, pool.run(run_case_with_stray_engine, case))


def _knob(record: CaseRecord) -> dict:
    [check] = [k for k in record.detail["knobs"] if k["knob"] == "offload_placement"]
    return check


def test_the_probe_runs_after_the_compared_run_and_leaves_it_alone(parity_pool: RankPool) -> None:
    case = CaseConfig(engine="builtin", reference="local", model="nested", cpu_offload=True, init_mode="never",
                      steps=2, check_determinism=True)
    record = _run(parity_pool, case)
    assert record.verdict == "pass" and record.deterministic, record.reason
    check = _knob(record)
    on_cpu = parity_pool.config.lane.device == "cpu"
    assert check["status"] == ("n/a" if on_cpu else "ok"), check
    assert f"at {len(PARAMETER_POINTS) + len(COMPUTE_POINTS)} points" in check["reason"], check
    # Without offload there is no promise to probe.
    plain = _run(parity_pool, case.replace(cpu_offload=False, check_determinism=False))
    assert all(k["knob"] != "offload_placement" for k in plain.detail["knobs"])


@pytest.mark.parametrize("case, not_observed", [
    (CaseConfig(engine="builtin", reference="local", model="moe", cpu_offload=True, sharding_strategy="no_shard",
                use_orig_params=True, init_mode="never", steps=1),
     "summon_offload_to_cpu not observed: FSDP1's summon_full_params refuses offload_to_cpu=True where a unit runs NO_SHARD"),
    (CaseConfig(engine="torch-fsdp2", reference="local", model="nested", cpu_offload=True, use_orig_params=True,
                backward_prefetch="pre", init_mode="never", steps=1),
     "summon, summon_offload_to_cpu not observed: fully_shard has no summon_full_params"),
], ids=["builtin-no_shard-moe", "torch-fsdp2"])
def test_each_engine_is_probed_with_the_utilities_it_has(parity_pool: RankPool, case: CaseConfig, not_observed: str) -> None:
    record = _run(parity_pool, case)
    assert record.verdict == "pass", record.reason
    check = _knob(record)
    assert check["status"] in ("n/a", "ok") and not_observed in check["reason"], check


# ---------------------------------------------------------------------------------------------------
# GPUs: ours and torch FSDP1 pass, the planted engine fails

#: engines whose offload cases run on the GPUs: ours, torch FSDP1, and the planted one.
ENGINES = ["builtin", "torch-fsdp", NAME]


def offload_cases(world_size: int) -> list[CaseConfig]:
    """The matrix's offload cases of ``ENGINES`` at ``world_size``: every non-hybrid strategy x
    ``use_orig_params`` x the two core models, fp32, against the local reference."""
    return generate(
        "full",
        axes={"engine": ENGINES, "model": ["nested", "transformer"],
              "sharding_strategy": ["full_shard", "shard_grad_op", "no_shard"], "use_orig_params": [False, True]},
        reference="local", precision="fp32", backward_prefetch="none", forward_prefetch=False, cpu_offload=True,
        init_mode="never", world_size=world_size, steps=2, stress="none", optimizer="sgd", checkpoint="none",
        resume_engine=None,
    )


def _check_engines(pool: RankPool, world_size: int) -> None:
    cases = offload_cases(world_size)
    assert {c.engine for c in cases} == set(ENGINES) and len(cases) == 36, [c.full_id for c in cases]
    problems = []
    for case in cases:
        record = _run(pool, case)
        if record.verdict in ("error", "timeout", "crash", "unsupported"):
            problems.append(f"{case.full_id}: {record.verdict}: {record.reason}")
            continue
        check = _knob(record)
        if case.engine == NAME:
            stray = stray_parameter(build_model(case.model, seed=case.seed, rank=0, world_size=world_size))
            if check["status"] != "ignored" or f"parameter {stray} at after_construction: on cuda" not in check["reason"]:
                problems.append(f"{case.full_id}: the planted engine's {stray} on the GPU was not named: {check}")
        elif check["status"] != "ok":
            problems.append(f"{case.full_id}: {check}")
        elif case.engine == "builtin" and record.verdict != "pass":
            problems.append(f"{case.full_id}: {record.reason}")
    assert not problems, "\n".join(problems)


one_gpu_pool = rank_pool_fixture(1, "cuda", timeout_s=300.0)


@pytest.mark.gpu
@needs_gpus(1)
def test_offload_placement_on_one_gpu(one_gpu_pool: RankPool) -> None:
    _check_engines(one_gpu_pool, 1)


@pytest.mark.gpu
@needs_gpus(1)
def test_offload_placement_on_two_gpu_ranks(gpu_pool: RankPool) -> None:
    _check_engines(gpu_pool, 2)
