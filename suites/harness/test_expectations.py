"""``harness.collect.expectations.ExpectedFailure``: the one type every suite names a known engine bug with (a
generated slice's cases, a ported check's subtests, a module's rank checks, a test's scenarios)."""

from __future__ import annotations

from harness.cases.case import CaseConfig
from harness.collect.expectations import ExpectedFailure, expected_failure

TORCH = CaseConfig(engine="torch-fsdp")
OURS = CaseConfig(engine="builtin")


def test_every_condition_given_must_hold() -> None:
    by_case = ExpectedFailure("offload", lambda case, device: case.cpu_offload)
    assert by_case.covers("cpu", case=TORCH.replace(cpu_offload=True)) and not by_case.covers("cpu", case=TORCH)
    assert not by_case.covers("cpu", engine="torch-fsdp", check="x"), "a predicate over cases covers no named check"
    named = ExpectedFailure("scaler", engine="torch-fsdp", device="cuda", checks=("bf16", "fp32_offload"))
    assert named.covers("cuda", engine="torch-fsdp", check="bf16")
    assert named.covers("cuda", engine="spec=fsdp1:x", check="bf16") is False, "the engine is matched by name"
    assert not named.covers("cpu", engine="torch-fsdp", check="bf16")
    assert not named.covers("cuda", engine="builtin", check="bf16")
    assert not named.covers("cuda", engine="torch-fsdp", check="fp16")
    of_engine = ExpectedFailure("hybrid", engine="torch-fsdp")
    assert of_engine.covers("cpu", case=TORCH) and not of_engine.covers("cpu", case=OURS), "a case names its engine"
    assert ExpectedFailure("everywhere").covers("cpu")


def test_the_first_covering_one_is_chosen() -> None:
    first, second = ExpectedFailure("a", device="cuda"), ExpectedFailure("b")
    assert expected_failure((first, second), "cuda") is first
    assert expected_failure((first, second), "cpu") is second
    assert expected_failure((), "cpu") is None
