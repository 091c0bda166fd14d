"""The optimizer and checkpoint axes as plain data: case fields, ids, rules, generators (no processes)."""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.run.runner import Selection, select_cases
from harness.selection.matrix import AXES, CHECKPOINT_RULES, WIDE_AXES, generate, invalid_reason, invalid_reasons


def test_defaults_leave_todays_ids_unchanged() -> None:
    case = CaseConfig()
    assert (case.optimizer, case.checkpoint, case.resume_engine, case.reshard) == ("sgd", "none", None, ())
    assert case.case_id == "full_shard-fp32-bwd_none-nested"
    assert CaseConfig(use_orig_params=True, world_size=4, steps=3).case_id == "full_shard-fp32-bwd_none-orig-nested-ws4-steps3"
    # the default matrix has the same cases and ids as before the axes existed: every id is free of the new segments
    for name in ("smoke", "pairwise"):
        assert not [c.case_id for c in generate(name) if any(s in c.case_id for s in ("adamw", "ckpt_", "resume_"))]


@pytest.mark.parametrize(("changes", "suffix"), [
    ({"optimizer": "adamw"}, "nested-adamw"),
    ({"checkpoint": "full"}, "nested-ckpt_full"),
    ({"checkpoint": "sharded", "optimizer": "adamw"}, "nested-adamw-ckpt_sharded"),
    ({"checkpoint": "local"}, "nested-ckpt_local"),
    ({"checkpoint": "full", "resume_engine": "builtin"}, "nested-ckpt_full-resume_builtin"),
    ({"checkpoint": "dcp-reshard", "reshard": (2, 4), "world_size": 4, "reference": "local"}, "nested-ws4-ckpt_dcp-2to4"),
    ({"checkpoint": "dcp-reshard", "reshard": (2, 1)}, "nested-ckpt_dcp-2to1"),
])
def test_id_segments(changes: dict, suffix: str) -> None:
    case = CaseConfig(**changes)
    assert case.case_id.endswith(suffix), case.case_id
    assert CaseConfig.from_dict(case.to_dict()) == case


@pytest.mark.parametrize(("changes", "needle"), [
    ({"optimizer": "adam"}, "optimizer"),
    ({"checkpoint": "dcp"}, "checkpoint"),
    ({"checkpoint": "full", "steps": 1}, "steps >= 2"),
    ({"checkpoint": "dcp-reshard"}, "reshard"),
    ({"reshard": (2, 4), "world_size": 4}, "reshard"),
    ({"checkpoint": "dcp-reshard", "reshard": (2, 4)}, "world_size=2"),
    ({"checkpoint": "dcp-reshard", "reshard": (2, 2)}, "two different"),
    ({"resume_engine": "", "checkpoint": "full"}, "resume_engine"),  # any name or spec is checked by the registry
])
def test_bad_fields_are_refused_by_name(changes: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CaseConfig(**changes)


def test_checkpoint_step_is_the_first_half() -> None:
    assert [CaseConfig(checkpoint="full", steps=n).checkpoint_step for n in (2, 3, 4, 5)] == [1, 1, 2, 2]


@pytest.mark.parametrize(("case", "rule"), [
    ({"engine": "torch-fsdp2", "checkpoint": "local"}, "fsdp2_no_local_state_dict"),
    ({"engine": "builtin", "checkpoint": "local", "resume_engine": "torch-fsdp2"}, "fsdp2_no_local_state_dict"),
    ({"engine": "builtin", "checkpoint": "local", "resume_engine": "torch-fsdp"}, "local_state_dict_same_engine"),
    ({"engine": "builtin", "checkpoint": "none", "resume_engine": "torch-fsdp"}, "resume_needs_checkpoint"),
    ({"engine": "builtin", "checkpoint": "full", "resume_engine": "builtin"}, "resume_engine_is_another"),
    ({"checkpoint": "dcp-reshard", "reshard": (2, 1), "reference": "ddp"}, "reshard_local_reference"),
    ({"checkpoint": "dcp-reshard", "reshard": (4, 2), "world_size": 4, "reference": "local",
      "sharding_strategy": "hybrid_shard"}, "reshard_one_dim"),
    ({"checkpoint": "dcp-reshard", "reshard": (2, 1), "reference": "local", "precision": "bf16"},
     "reshard_to_plain_full_precision"),
])
def test_checkpoint_rules(case: dict, rule: str) -> None:
    (found,) = [r for r in CHECKPOINT_RULES if r.name == rule]
    assert found.reason in invalid_reasons(case)


@pytest.mark.parametrize("case", [
    {"engine": "builtin", "checkpoint": "local"},
    {"engine": "torch-fsdp2", "checkpoint": "sharded", "use_orig_params": True, "backward_prefetch": "pre",
     "resume_engine": "builtin"},
    {"engine": "torch-fsdp", "checkpoint": "full", "resume_engine": "builtin", "optimizer": "adamw"},
    {"checkpoint": "dcp-reshard", "reshard": (4, 2), "world_size": 4, "reference": "local"},
])
def test_expressible_checkpoint_cases_are_valid(case: dict) -> None:
    assert invalid_reason(case) is None


def test_wide_axes_generate_checkpoint_cases() -> None:
    axes = {"engine": ["torch-fsdp2"], "checkpoint": WIDE_AXES["checkpoint"], "optimizer": WIDE_AXES["optimizer"]}
    cases = generate("pairwise", axes=axes)
    assert {c.checkpoint for c in cases} == {"none", "full", "sharded"}  # FSDP2 has no local
    assert {c.optimizer for c in cases} == set(WIDE_AXES["optimizer"])
    # a resumed run builds one optimizer over the engine's parameters: no named optimizer is resumed
    assert {c.optimizer for c in cases if c.checkpoint != "none"} == {"sgd", "adamw"}
    assert set(AXES["checkpoint"]) == {"none"}, "the default products keep their size"


def test_filter_ckpt_selects_the_checkpoint_cases() -> None:
    wide = Selection(matrix="smoke", checkpoints=["none", "full", "sharded", "local"], optimizers=["sgd", "adamw"])
    everything = select_cases(wide, [2])
    chosen = select_cases(Selection(**{**wide.__dict__, "filters": ["ckpt_"]}), [2])
    assert chosen and {c.full_id for c in chosen} == {c.full_id for c in everything if c.checkpoint != "none"}
    assert {c.checkpoint for c in chosen} == {"full", "sharded", "local"}
    assert "adamw" in {c.optimizer for c in everything}
    with pytest.raises(ValueError, match="--checkpoints"):
        select_cases(Selection(checkpoints=["dcp-reshard"]), [2])
