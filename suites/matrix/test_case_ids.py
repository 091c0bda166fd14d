"""Case ids: one per distinct case, over the generated matrix and over any two configs that train differently."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.case import DEFAULT_ENGINES, FIELD_VALUES, CaseConfig
from harness.cases.models import zoo_names
from harness.selection.matrix import AXES, WIDE_AXES, generate

#: Fields the id leaves out by design (``CaseConfig.case_id``): no generator varies them, or (for
#: ``check_determinism``) they run the same case again.
_NOT_IN_ID = {"seed", "lr", "momentum", "check_determinism"}


def test_the_wide_axes_have_one_id_per_case() -> None:
    # The default generators' ids: test_matrix.py's test_generated_cases_are_valid_and_ids_unique.
    cases = generate("pairwise", axes={**AXES, **WIDE_AXES})
    ids = [c.full_id for c in cases]
    assert len(set(ids)) == len(ids) == len(set(cases))


def test_hybrid_shard_sizes_are_cases_of_their_own_and_the_default_keeps_its_id() -> None:
    default = CaseConfig(sharding_strategy="hybrid_shard", world_size=8)
    sizes = [default] + [default.replace(extras=(("shard_size", n),)) for n in (1, 2, 8)]
    assert len({c.case_id for c in sizes}) == len(sizes)
    assert default.case_id == "hybrid_shard-fp32-bwd_none-nested-ws8"
    assert sizes[2].case_id == "hybrid_shard-fp32-bwd_none-nested-ws8-shard2"
    # A planted fault is the same case on a broken engine: it keeps the case's id.
    assert default.replace(extras=(("fault", "perturb_grad_rank1"),)).case_id == default.case_id


def test_fsdp1_forms_and_micro_batch_counts_are_cases_of_their_own() -> None:
    hybrid = CaseConfig(sharding_strategy="hybrid_shard", world_size=4, grad_accum="no_sync")
    mesh = hybrid.replace(extras=(("hybrid_groups", "mesh"),))
    three = hybrid.replace(extras=(("micro_batches", 3),))
    around = CaseConfig(activation_checkpointing="reentrant", extras=(("checkpoint_wrapper", "around"),))
    assert mesh.case_id == "hybrid_shard-fp32-bwd_none-nested-ws4-accum2_nosync-groups_mesh"
    assert three.case_id == "hybrid_shard-fp32-bwd_none-nested-ws4-accum3_nosync"
    assert three.micro_batches(1) == [3, 4, 5] and hybrid.micro_batches(1) == [2, 3]
    assert around.case_id == "full_shard-fp32-bwd_none-nested-ac_reentrant-ac_around_units"
    # The defaults spelled out are the same cases.
    assert hybrid.replace(extras=(("hybrid_groups", "pair"),)).case_id == hybrid.case_id


@pytest.mark.parametrize(("fields", "message"), [
    (dict(extras=(("hybrid_groups", "mesh"),)), "hybrid_groups goes with a hybrid sharding_strategy"),
    (dict(sharding_strategy="hybrid_shard", extras=(("hybrid_groups", "grid"),)), r"hybrid_groups='grid' is not one of"),
    (dict(extras=(("checkpoint_wrapper", "around"),)), "checkpoint_wrapper needs activation_checkpointing"),
    (dict(extras=(("micro_batches", 3),)), "micro_batches=3 must be an int of at least 2, with grad_accum"),
    (dict(grad_accum="sync", extras=(("micro_batches", 1),)), "micro_batches=1 must be an int of at least 2"),
])
def test_bad_extras_name_the_extra(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CaseConfig(**fields)


_HINTS = get_type_hints(CaseConfig)


def _value(name: str, draw: st.DrawFn) -> Any:
    """A value of field ``name``: any of a literal's, an engine or zoo model by name, a few numbers."""
    if name in FIELD_VALUES:
        return draw(st.sampled_from(FIELD_VALUES[name]))
    if _HINTS[name] is bool:
        return draw(st.booleans())
    if name == "engine":
        return draw(st.sampled_from(DEFAULT_ENGINES))
    if name == "resume_engine":
        return draw(st.sampled_from([None, *DEFAULT_ENGINES]))
    if name == "model":
        return draw(st.sampled_from(zoo_names()))
    assert name in ("world_size", "steps"), f"no values drawn for CaseConfig.{name}: add them here"
    return draw(st.integers(1, 8))


@st.composite
def configs(draw: st.DrawFn) -> CaseConfig:
    """A valid config over every field the id covers; the others at their defaults."""
    fields = {f.name: _value(f.name, draw) for f in dataclasses.fields(CaseConfig) if f.name not in _NOT_IN_ID | {"extras", "reshard"}}
    if fields["checkpoint"] == "dcp-reshard":
        fields["world_size"] = max(fields["world_size"], 2)
        other = draw(st.integers(1, fields["world_size"] - 1))
        fields["reshard"] = tuple(draw(st.permutations([fields["world_size"], other])))
    if fields["checkpoint"] != "none":
        fields["steps"] = max(fields["steps"], 2)
    shard = draw(st.sampled_from([None, 1, 2, 4]))
    return CaseConfig(**fields, extras=(("shard_size", shard),) if shard is not None else ())


@settings(max_examples=300, deadline=None)
@given(configs(), configs())
def test_distinct_configs_have_distinct_ids(a: CaseConfig, b: CaseConfig) -> None:
    # b, and a with each one field of b: neighbours differ in one field, where a collision would hide.
    others = [b]
    for field in dataclasses.fields(CaseConfig):
        try:
            others.append(a.replace(**{field.name: getattr(b, field.name)}))
        except ValueError:  # a field another one constrains (reshard and world_size)
            pass
    for other in others:
        assert (a == other) == (a.full_id == other.full_id), (a, other)
