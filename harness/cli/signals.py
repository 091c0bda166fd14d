"""SIGTERM handled like Ctrl-C by the commands that run cases: a CI runner or ``kill`` stopping a run
gets the same clean stop (ranks killed, the pool's directory removed) and the same resume hint."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "interrupt_exit_status", "terminate_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised in the main thread where Ctrl-C's ``KeyboardInterrupt`` would be."""


def interrupt_exit_status(exc: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside this block SIGTERM raises ``Terminated``; the previous handler is restored after it.
    Only the main thread can take signals; elsewhere (a command called from a thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
