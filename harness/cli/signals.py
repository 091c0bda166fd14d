"""SIGTERM and SIGHUP handled like Ctrl-C by the commands that run cases: a CI runner or ``kill``
stopping a run, or the terminal it ran in closing, gets the same clean stop (ranks killed, the pool's
directory removed) and the same resume hint, shell-quoted (``resume_command``).

Exit status: the shell's convention, 128 + the signal number: 130 on Ctrl-C (SIGINT), 143 on SIGTERM,
129 on SIGHUP."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["STOP_SIGNALS", "Terminated", "interrupt_exit_status", "resume_command", "terminate_as_interrupt"]

#: the signals that stop a run like Ctrl-C does.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (``signum``); raised in the main thread where Ctrl-C's
    ``KeyboardInterrupt`` would be."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def interrupt_exit_status(exc: KeyboardInterrupt) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def resume_command(*argv: str | os.PathLike[str]) -> str:
    """The words of the command that continues a stopped run, shell-quoted: a path with a space or a
    quote in it stays one word when the line is pasted back into a shell."""
    return shlex.join(map(os.fspath, argv))


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside this block SIGTERM and SIGHUP raise ``Terminated``; the previous handlers are restored
    after it. Only the main thread can take signals; elsewhere (a command called from a thread) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
