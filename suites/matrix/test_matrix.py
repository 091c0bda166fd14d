"""The case matrix: rules, the three generators, and the pairwise covering proof."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.case import CaseConfig
from harness.selection.matrix import (
    AXES,
    CHECKPOINT_RULES,
    WIDE_AXES,
    rules_for,
    feasible_pairs,
    generate,
    invalid_reason,
    invalid_reasons,
    pairs_uncovered,
)

REPO = Path(__file__).resolve().parents[2]


def brute_force(axes: dict[str, list]) -> list[CaseConfig]:
    """The oracle: every combination, filtered by the rules one case at a time."""
    names = list(axes)
    cases = [CaseConfig(**dict(zip(names, values))) for values in itertools.product(*axes.values())]
    return [c for c in cases if invalid_reason(c) is None]


def pairs_in(cases: list[CaseConfig], names: list[str]) -> set:
    out = set()
    for case in cases:
        for a, b in itertools.combinations(names, 2):
            out.add(((a, getattr(case, a)), (b, getattr(case, b))))
    return out


@st.composite
def sub_axes(draw: st.DrawFn, *, max_cases: int = 2500) -> dict[str, list]:
    """A random non-empty subset of every axis's values, small enough to brute-force."""
    axes = {}
    for name, values in AXES.items():
        size = draw(st.integers(1, min(len(values), 3)))
        axes[name] = draw(st.permutations(values))[:size]
    total = 1
    for values in axes.values():
        total *= len(values)
    if total > max_cases:
        # Shrink the biggest axes until the oracle stays cheap; still a random choice of values.
        for name in sorted(axes, key=lambda n: -len(axes[n])):
            while total > max_cases and len(axes[name]) > 1:
                total //= len(axes[name])
                axes[name] = axes[name][:-1]
                total *= len(axes[name])
    return axes


# --- rules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "rule"),
    [
        (CaseConfig(cpu_offload=True, init_mode="after"), "offload_after_wrap"),
        (CaseConfig(sharding_strategy="hybrid_shard", world_size=2), "hybrid_world_size"),
        (CaseConfig(sharding_strategy="hybrid_shard_zero2", world_size=5), "hybrid_world_size"),
        (CaseConfig(engine="torch-fsdp2", use_orig_params=False, backward_prefetch="pre"), "fsdp2_has_no_flat_params"),
        (CaseConfig(engine="torch-fsdp2", use_orig_params=True, backward_prefetch="post"), "fsdp2_backward_prefetch"),
    ],
)
def test_each_rule_rejects_its_combination_with_its_reason(case: CaseConfig, rule: str) -> None:
    (matching,) = [r for r in rules_for([case.engine]) if r.name == rule]
    assert invalid_reasons(case) == [matching.reason]
    assert invalid_reason(case) == matching.reason


@pytest.mark.parametrize(
    "case",
    [
        CaseConfig(),
        CaseConfig(cpu_offload=True, init_mode="never"),
        CaseConfig(cpu_offload=True, init_mode="before"),
        CaseConfig(sharding_strategy="hybrid_shard", world_size=4),
        CaseConfig(engine="torch-fsdp2", use_orig_params=True, backward_prefetch="pre"),
    ],
)
def test_neighbouring_combinations_stay_valid(case: CaseConfig) -> None:
    assert invalid_reason(case) is None


def test_reasons_combine_and_mappings_are_completed_with_defaults() -> None:
    case = {"engine": "torch-fsdp2", "cpu_offload": True, "init_mode": "after"}
    reasons = invalid_reasons(case)
    assert len(reasons) == 3  # offload after wrap, no flat params, no bwd_none on FSDP2
    assert invalid_reason(case) == "; ".join(reasons)


#: axes one-valued by default and widened on request: the rules reading them are checked on WIDE_AXES.
_WIDENED = {a for a in WIDE_AXES if len(AXES[a]) == 1}


def test_every_rule_removes_something_from_the_default_product() -> None:
    product = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]
    for rule in rules_for(AXES["engine"]):
        if rule in CHECKPOINT_RULES or _WIDENED & set(rule.axes):
            continue  # their axes are one-valued by default: see the next test
        if rule.name == "engine_strategies":
            continue  # the strategies off the default axis (ZeRO-1/2): suites/plugins/test_engine_contract.py
        assert any(rule.matches({**CaseConfig().to_dict(), **c}) for c in product), rule.name


def test_every_checkpoint_rule_removes_something_from_the_wide_axes() -> None:
    values = {**AXES, **WIDE_AXES, "checkpoint": [*WIDE_AXES["checkpoint"], "dcp-reshard"], "reshard": [(), (2, 1)]}
    for rule in [*CHECKPOINT_RULES, *(r for r in rules_for(AXES["engine"]) if _WIDENED & set(r.axes))]:
        product = [dict(zip(rule.axes, v)) for v in itertools.product(*(values[a] for a in rule.axes))]
        assert any(rule.matches({**CaseConfig().to_dict(), **c}) for c in product), rule.name


# --- generators ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full() -> list[CaseConfig]:
    return generate("full")


@pytest.fixture(scope="module")
def pairwise() -> list[CaseConfig]:
    return generate("pairwise")


def test_full_is_the_product_minus_invalid(full: list[CaseConfig]) -> None:
    assert [c.full_id for c in full] == [c.full_id for c in brute_force(AXES)]


@pytest.mark.parametrize("name", ["full", "pairwise", "smoke"])
def test_generated_cases_are_valid_and_ids_unique(name: str) -> None:
    cases = generate(name)
    assert cases
    assert [c for c in cases if invalid_reason(c) is not None] == []
    ids = [c.full_id for c in cases]
    assert len(set(ids)) == len(ids)


def test_pairwise_covers_every_feasible_pair_in_far_fewer_cases(full: list[CaseConfig], pairwise: list[CaseConfig]) -> None:
    assert pairs_uncovered(pairwise) == set()
    # The proof does not trust the generator's own notion of feasibility: the pairs of the full valid
    # product are exactly the pairs the pairwise cases hold.
    names = list(AXES)
    assert pairs_in(pairwise, names) == pairs_in(full, names) == feasible_pairs()
    # No covering array can be smaller than the largest two-axis product of feasible values.
    lower_bound = max(
        sum(1 for p in feasible_pairs() if (p[0][0], p[1][0]) == (a, b)) for a, b in itertools.combinations(names, 2)
    )
    print(f"\npairwise: {len(pairwise)} cases cover all {len(feasible_pairs())} feasible pairs; "
          f"full product: {len(full)} valid cases; lower bound {lower_bound}")
    assert lower_bound <= len(pairwise) <= 2 * lower_bound
    assert len(pairwise) * 100 < len(full)


def test_pairs_uncovered_notices_a_missing_case(pairwise: list[CaseConfig]) -> None:
    for dropped in range(len(pairwise)):
        rest = pairwise[:dropped] + pairwise[dropped + 1 :]
        missing = pairs_uncovered(rest)
        # Every pair only the dropped case held is reported, and nothing else.
        only_there = pairs_in([pairwise[dropped]], list(AXES)) - pairs_in(rest, list(AXES))
        assert missing == only_there


def test_pairs_uncovered_ignores_invalid_cases() -> None:
    bad = CaseConfig(cpu_offload=True, init_mode="after")
    axes = {"cpu_offload": [True], "init_mode": ["after", "never"]}
    assert (("cpu_offload", True), ("init_mode", "never")) in pairs_uncovered([bad], axes)


@settings(max_examples=40, deadline=None)
@given(axes=sub_axes())
def test_pairwise_covers_random_axes(axes: dict[str, list]) -> None:
    cases = generate("pairwise", axes)
    valid = brute_force(axes)
    assert all(invalid_reason(c) is None for c in cases)
    assert pairs_uncovered(cases, axes) == set()
    assert pairs_in(cases, list(AXES)) == pairs_in(valid, list(AXES))
    assert len({c.full_id for c in cases}) == len(cases) <= max(len(valid), 1)
    assert bool(cases) == bool(valid)


@settings(max_examples=40, deadline=None)
@given(axes=sub_axes(max_cases=400))
def test_full_matches_the_oracle_on_random_axes(axes: dict[str, list]) -> None:
    assert generate("full", axes) == brute_force(axes)


def test_generators_are_deterministic_across_hash_seeds() -> None:
    script = (
        "import json; from harness.selection.matrix import generate; "
        "print(json.dumps({n: [c.full_id for c in generate(n)] for n in ('pairwise', 'smoke')}))"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
            env=os.environ | {"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert outputs[0] == outputs[1]
    here = {n: [c.full_id for c in generate(n)] for n in ("pairwise", "smoke")}
    assert json.loads(outputs[0]) == here


def test_fixed_keywords_pin_fields_and_leave_the_axes() -> None:
    cases = generate("pairwise", engine="builtin", seed=3, check_determinism=True)
    assert {c.engine for c in cases} == {"builtin"}
    assert {(c.seed, c.check_determinism) for c in cases} == {(3, True)}
    assert pairs_uncovered(cases, engine="builtin") == set()
    assert pairs_uncovered(cases) != set(), "other engines' pairs are not covered"


def test_axes_override_only_the_named_axes() -> None:
    cases = generate("full", {"precision": ["fp32"], "model": ["nested"], "world_size": [2], "init_mode": ["before"]})
    assert {c.precision for c in cases} == {"fp32"}
    assert {c.sharding_strategy for c in cases} == {"full_shard", "shard_grad_op", "no_shard"}
    assert {c.engine for c in cases} == set(AXES["engine"])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: generate("random"), "name='random'"),
        (lambda: generate("full", {"seed": [0, 1]}), "unknown axis 'seed'"),
        (lambda: generate("full", {"precision": []}), "empty"),
        (lambda: generate("full", {"precision": ["fp8"]}), "precision='fp8'"),
        (lambda: generate("full", colour="red"), "'colour' is not a CaseConfig field"),
        (lambda: generate("full", {"engine": ["builtin"]}, engine="builtin"), "both an axis and pinned"),
    ],
)
def test_bad_arguments_name_the_parameter(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_smoke_is_a_handful_touching_every_engine_and_feature() -> None:
    cases = generate("smoke")
    assert 3 <= len(cases) <= 15
    assert {c.engine for c in cases} == set(AXES["engine"])
    for engine in AXES["engine"]:
        mine = [c for c in cases if c.engine == engine]
        assert {c.sharding_strategy for c in mine} >= {"full_shard", "shard_grad_op", "no_shard"}
        assert any(c.cpu_offload for c in mine) and any(c.precision_spec.is_mixed for c in mine)
    assert max(c.world_size for c in cases) == 2, "smoke runs on two ranks"


def test_smoke_respects_restricted_axes() -> None:
    cases = generate("smoke", {"precision": ["fp32"]}, engine="torch-fsdp")
    assert cases and {(c.engine, c.precision) for c in cases} == {("torch-fsdp", "fp32")}
