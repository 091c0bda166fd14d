"""The training-state lifecycle of an FSDP instance: every change asserts the state it leaves, and a
summon restores IDLE however its body ends. Pure; no process group."""

from __future__ import annotations

import pytest

from engine.lifecycle import TrainingLifecycle, TrainingState


def test_one_iteration_passes_through_every_state() -> None:
    life = TrainingLifecycle("Block")
    seen = [life.state]
    for step in (life.to_forward, life.forward_done, life.to_pre_backward, life.to_post_backward, life.backward_done):
        step()
        seen.append(life.state)
    assert seen == [
        TrainingState.IDLE,
        TrainingState.FORWARD,
        TrainingState.IDLE,
        TrainingState.PRE_BACKWARD,
        TrainingState.POST_BACKWARD,
        TrainingState.IDLE,
    ]


@pytest.mark.parametrize(
    "setup, call, found",
    [
        ([], "forward_done", "IDLE"),
        (["to_forward"], "to_forward", "FORWARD"),
        (["to_forward"], "to_pre_backward", "FORWARD"),
        (["to_forward"], "to_post_backward", "FORWARD"),
        (["to_pre_backward", "to_post_backward"], "to_pre_backward", "POST_BACKWARD"),
        (["to_forward"], "backward_done", "FORWARD"),
    ],
)
def test_a_change_in_the_wrong_state_names_the_unit_and_the_states(setup: list[str], call: str, found: str) -> None:
    life = TrainingLifecycle("Block")
    for name in setup:
        getattr(life, name)()
    with pytest.raises(AssertionError, match=rf"unit wrapping Block: .* in training state {found}, expected"):
        getattr(life, call)()
    assert life.state.name == found, "a refused change leaves the state as it was"


def test_forward_inside_backward_is_allowed_for_recomputation() -> None:
    life = TrainingLifecycle("Block")
    life.to_pre_backward()
    life.to_forward()
    life.forward_done()
    life.to_post_backward()
    life.backward_done()
    assert life.idle


def test_summoning_restores_idle_and_refuses_reentry() -> None:
    life = TrainingLifecycle("Block")
    with pytest.raises(KeyError):
        with life.summoning():
            assert life.state == TrainingState.SUMMON_FULL_PARAMS
            with pytest.raises(RuntimeError, match="unit wrapping Block is SUMMON_FULL_PARAMS"):
                with life.summoning():
                    pass
            raise KeyError("the body fails")
    assert life.idle
    life.to_forward()
    with pytest.raises(RuntimeError, match="during forward or backward"):
        with life.summoning():
            pass
