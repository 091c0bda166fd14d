"""The training state of one FSDP instance and the only place it changes.

Each instance (its :class:`~engine.state.ModuleState`) owns one :class:`TrainingLifecycle`; its
unit, if it has parameters, holds the same object, never a copy. Every change is a named method
that asserts the state it leaves, so a hook or a utility running at the wrong time fails with the
instance, the state found and the states expected, instead of going on silently. A temporary
state (``summon_full_params``) is a context manager that restores IDLE in ``finally``.
"""

from __future__ import annotations

import contextlib
from enum import Enum, auto
from typing import Iterator

__all__ = ["TrainingLifecycle", "TrainingState"]


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


_IDLE, _FORWARD, _PRE, _POST, _SUMMON = (
    TrainingState.IDLE,
    TrainingState.FORWARD,
    TrainingState.PRE_BACKWARD,
    TrainingState.POST_BACKWARD,
    TrainingState.SUMMON_FULL_PARAMS,
)


class TrainingLifecycle:
    """IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE, and IDLE <-> SUMMON_FULL_PARAMS."""

    def __init__(self, owner: str) -> None:
        #: what the errors name: the wrapped module's class.
        self.owner = owner
        self._state = _IDLE

    @property
    def state(self) -> TrainingState:
        return self._state

    @property
    def idle(self) -> bool:
        return self._state == _IDLE

    def _move(self, allowed: tuple[TrainingState, ...], to: TrainingState, what: str) -> None:
        if self._state not in allowed:
            raise AssertionError(
                f"FSDP unit wrapping {self.owner}: {what} in training state {self._state.name}, expected "
                f"{' or '.join(s.name for s in allowed)}"
            )
        self._state = to

    def to_forward(self) -> None:
        # A forward inside backward is activation checkpointing recomputing it.
        self._move((_IDLE, _PRE, _POST), _FORWARD, "pre-forward")

    def forward_done(self) -> None:
        self._move((_FORWARD,), _IDLE, "post-forward")

    def to_pre_backward(self) -> None:
        self._move((_IDLE,), _PRE, "pre-backward")

    def to_post_backward(self) -> None:
        # IDLE: no pre-backward hook ran (no output of the unit carried a gradient to it).
        self._move((_IDLE, _PRE), _POST, "post-backward")

    def backward_done(self) -> None:
        self._move((_IDLE, _PRE, _POST), _IDLE, "the end of backward")

    @contextlib.contextmanager
    def summoning(self) -> Iterator[None]:
        """SUMMON_FULL_PARAMS for the duration (from IDLE only)."""
        if self._state != _IDLE:
            raise RuntimeError(
                f"summon_full_params cannot be entered during forward or backward or while already "
                f"summoned (unit wrapping {self.owner} is {self._state.name}): call it between iterations"
            )
        self._state = _SUMMON
        try:
            yield
        finally:
            self._state = _IDLE

    def __repr__(self) -> str:
        return f"TrainingLifecycle({self.owner}, {self._state.name})"
