"""The training-loop axes as plain data: case fields, ids, rules, the named slice and the selection
options (no processes)."""

from __future__ import annotations

import argparse

import pytest

from harness.cases.case import CaseConfig, loop_segments
from harness.cases.records import not_run_text, parse_not_run
from harness.cli.options import add_selection, selection_options
from harness.run.runner import Selection, select_cases
from harness.selection.matrix import AXES, LOOP_SLICE, LOOP_SMOKE_VARIANTS, generate, invalid_reason, pairs_uncovered


def test_defaults_keep_todays_ids() -> None:
    case = CaseConfig()
    assert (case.clip_grad, case.grad_accum, case.activation_checkpointing, case.compile) == ("none",) * 4
    assert loop_segments(case) == [] and case.case_id == "full_shard-fp32-bwd_none-nested"
    assert all(AXES[axis] == [LOOP_SLICE[axis][0]] for axis in LOOP_SLICE), "one value each by default"
    for name in ("smoke", "pairwise"):
        ids = [c.case_id for c in generate(name)]
        assert not [i for i in ids if any(s in i for s in ("clip_", "accum", "ac_", "compiled", "groups", "two_opt"))]


@pytest.mark.parametrize(("changes", "suffix"), [
    ({"clip_grad": "norm"}, "nested-clip_norm"),
    ({"grad_accum": "no_sync"}, "nested-accum2_nosync"),
    ({"grad_accum": "sync"}, "nested-accum2_sync"),
    ({"activation_checkpointing": "non_reentrant"}, "nested-ac_nonreentrant"),
    ({"activation_checkpointing": "reentrant"}, "nested-ac_reentrant"),
    ({"compile": "compiled"}, "nested-compiled"),
    ({"optimizer": "adamw_groups", "clip_grad": "norm"}, "nested-adamw_groups-clip_norm"),
    ({"optimizer": "two_optimizers"}, "nested-two_optimizers"),
])
def test_id_segments(changes: dict, suffix: str) -> None:
    case = CaseConfig(**changes)
    assert case.case_id.endswith(suffix), case.case_id
    assert CaseConfig.from_dict(case.to_dict()) == case


@pytest.mark.parametrize("field", ["clip_grad", "grad_accum", "activation_checkpointing", "compile"])
def test_bad_values_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CaseConfig(**{field: "sometimes"})


def test_micro_batches_keep_the_step_without_accumulation() -> None:
    assert CaseConfig().micro_batches(3) == [3]
    assert CaseConfig(grad_accum="no_sync").micro_batches(3) == [6, 7]
    assert CaseConfig(grad_accum="sync").micro_batches(0) == [0, 1]


@pytest.mark.parametrize(("case", "rule"), [
    ({"engine": "torch-fsdp", "optimizer": "adamw_groups"}, "use_orig_params=True"),
    ({"engine": "builtin", "optimizer": "two_optimizers"}, "use_orig_params=True"),
    ({"engine": "builtin", "compile": "compiled"}, "Dynamo only supports FSDP with use_orig_params=True"),
    ({"engine": "torch-fsdp", "grad_accum": "sync", "cpu_offload": True, "use_orig_params": True}, "outside no_sync()"),
    ({"engine": "builtin", "checkpoint": "full", "optimizer": "adamw_groups", "use_orig_params": True}, "one optimizer"),
    ({"engine": "builtin", "checkpoint": "full", "compile": "compiled", "use_orig_params": True}, "does not compile"),
])
def test_rules_say_why(case: dict, rule: str) -> None:
    reason = invalid_reason(case)
    assert reason is not None and rule in reason, reason


@pytest.mark.parametrize("case", [
    {"engine": "builtin", "grad_accum": "sync", "cpu_offload": True},  # ours accumulates outside no_sync with offload
    {"engine": "torch-fsdp2", "optimizer": "adamw_groups", "use_orig_params": True, "backward_prefetch": "pre",
     "compile": "compiled", "activation_checkpointing": "reentrant"},
    {"engine": "torch-fsdp", "optimizer": "two_optimizers", "use_orig_params": True, "grad_accum": "no_sync",
     "cpu_offload": True},
])
def test_expressible_loop_cases_are_valid(case: dict) -> None:
    assert invalid_reason(case) is None


def test_the_loop_slice_walked_pairwise_covers_every_feasible_pair() -> None:
    axes = {**LOOP_SLICE, "model": ["nested", "transformer"], "use_orig_params": [False, True]}
    cases = generate("pairwise", axes=axes)
    assert cases and not pairs_uncovered(cases, axes=axes)
    for axis, values in LOOP_SLICE.items():
        assert {getattr(c, axis) for c in cases} == set(values), axis


def test_the_smoke_variants_show_every_value() -> None:
    for axis, values in LOOP_SLICE.items():
        seen = {v.get(axis, values[0]) for v in LOOP_SMOKE_VARIANTS}
        assert set(values) - {"adamw"} <= seen, axis  # adamw has smoke cases of its own (checkpoints)


def _selection(*argv: str) -> Selection:
    parser = argparse.ArgumentParser()
    add_selection(parser)
    return selection_options(parser.parse_args(list(argv))).selection()


def test_options_widen_the_axes_and_filter_knows_the_segments() -> None:
    chosen = select_cases(_selection("--matrix", "pairwise", "--engines", "builtin", "--references", "local", "--grad-accum", "none,no_sync",
                                     "--clip-grad", "none,norm", "--filter", "accum2_nosync"), [2])
    assert chosen and all(c.grad_accum == "no_sync" for c in chosen)
    assert {c.clip_grad for c in chosen} <= {"none", "norm"}
    wide = _selection("--loop-axes")
    assert wide.loop_axes == {a: LOOP_SLICE[a] for a in wide.loop_axes} and len(wide.loop_axes) == 4
    assert wide.optimizers == LOOP_SLICE["optimizer"]
    with pytest.raises(ValueError, match="--compile"):
        select_cases(_selection("--compile", "inductor"), [2])


@pytest.mark.parametrize("changes", [
    {},
    {"optimizer": "adamw_groups", "clip_grad": "norm", "grad_accum": "no_sync", "activation_checkpointing": "reentrant",
     "compile": "compiled", "use_orig_params": True},
    {"optimizer": "two_optimizers", "grad_accum": "sync", "activation_checkpointing": "non_reentrant", "stress": "delay"},
])
def test_reports_read_the_loop_axes_from_the_config(changes: dict) -> None:
    from reports.resume_matrix import resume_suffix
    from reports.scope import RunScope, not_run_frame

    case = CaseConfig(engine="builtin", **changes)
    (read,) = not_run_frame(RunScope(1, parse_not_run(not_run_text([(case, "budget")])))).to_dict("records")
    assert {a: read[a] for a in LOOP_SLICE} == {a: getattr(case, a) for a in LOOP_SLICE}
    suffix = resume_suffix({a: getattr(case, a) for a in (*LOOP_SLICE, "checkpoint")})
    assert all(segment in suffix for segment in loop_segments(case)), suffix
