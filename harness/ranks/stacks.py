"""Why a pool's job did not answer, read from its ranks: the frame a rank's stack is at, the rank the
others wait for in a hang, the telling line of a crashed rank's stderr; file paths in that text
written relative to the tree and the Python installation, so records and reports name no machine's
directories. Pure functions over the text of faulthandler dumps, tracebacks and exit codes
(``harness.ranks.pool`` collects them)."""

from __future__ import annotations

import os
import re
import signal
import sysconfig
from pathlib import Path
from typing import Mapping

__all__ = ["behind_ranks", "describe_exit", "innermost_frame", "last_line", "portable_paths", "timeout_reason"]


def local_prefixes() -> dict[str, str]:
    """This machine's directories and what :func:`portable_paths` writes for them: the tree's root
    (paths become relative to it), the installed packages and the standard library."""
    paths = sysconfig.get_paths()
    return {
        str(Path(__file__).resolve().parents[2]) + os.sep: "",
        paths["purelib"] + os.sep: "<site-packages>/",
        paths["platlib"] + os.sep: "<site-packages>/",
        paths["stdlib"] + os.sep: "<stdlib>/",
    }


def portable_paths(text: str, prefixes: Mapping[str, str] | None = None) -> str:
    """``text`` with every directory of ``prefixes`` (default: :func:`local_prefixes`) replaced by
    its short form, the longest first (the installed packages lie inside the standard library's
    directory)."""
    table = local_prefixes() if prefixes is None else prefixes
    for prefix in sorted(table, key=len, reverse=True):
        text = text.replace(prefix, table[prefix])
    return text


def describe_exit(code: int) -> str:
    if code == -999:
        return "died (exit code unknown)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


_TELLING = re.compile(r"Error|error|what\(\)|Fatal|Exception|Assert|Segmentation|injected")


def last_line(text: str) -> str:
    """The line of a crashed rank's stderr that best says why: the last one naming an error."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    telling = [line for line in lines if _TELLING.search(line)]
    chosen = telling[-1] if telling else lines[-1] if lines else ""
    return chosen[:200]


def _frame_text(frame: str) -> str:
    match = re.match(r'File "(.*)", line (\d+) in (.*)', frame)
    return f"{Path(match[1]).name}:{match[2]} in {match[3]}" if match else frame


def innermost_frame(stack: str) -> str:
    """Where the signalled thread of a faulthandler dump is: its innermost frame, and the innermost
    frame outside torch and the standard library (the code that made the call)."""
    frames = _main_thread_frames(stack)
    if not frames:
        return ""
    # faulthandler prints the innermost frame first.
    where = _frame_text(frames[0])
    library = (os.sep + "torch" + os.sep, os.sep + "multiprocessing" + os.sep, "<string>")
    caller = next((f for f in frames if not any(part in f for part in library)), None)
    if caller is not None and caller != frames[0]:
        where += f", called from {_frame_text(caller)}"
    return where


# [Note: which rank a timeout names]
# A hang shows on every rank at once: the rank that stopped making progress (stuck in forward, in a
# data loader, in user code) and the ranks blocked waiting for it inside a collective. The reason
# must name the first, whose stack is the bug; the waiting ranks' frames only say "all_gather".
# A rank waits when the innermost frame of its main thread is torch.distributed's or autograd's
# (a blocking collective, or the backward pass whose hooks wait on reductions): the C call it
# blocks in was made from there. Ranks stuck anywhere else are behind. When every rank waits
# (mismatched collectives: one skipped a collective and waits in the next) or none does (all
# hang outside collectives), no rank is behind the others and the first stuck rank is named.
# With NCCL a waiting rank often blocks later, in a CUDA synchronisation of its own code, and
# then looks behind too: the rule names the first of them, which is no worse than before.
_WAIT_LOCATIONS = tuple(os.sep + os.path.join("torch", part) + os.sep for part in ("distributed", "autograd"))


def _main_thread_frames(stack: str) -> list[str]:
    """The frames (innermost first) of the signalled thread of a faulthandler dump."""
    blocks: list[tuple[str, list[str]]] = []
    for line in stack.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append((line, []))
        elif line.strip().startswith("File ") and blocks:
            blocks[-1][1].append(line.strip())
    if not blocks:
        return []
    # The signal lands on the main thread, which faulthandler calls the current one.
    return next((b for b in blocks if b[0].startswith("Current thread")), blocks[-1])[1]


def _waits_in_collective(stack: str) -> bool:
    frames = _main_thread_frames(stack)
    return bool(frames) and any(part in frames[0] for part in _WAIT_LOCATIONS)


def behind_ranks(stuck: list[int], stacks: dict[int, str]) -> list[int]:
    """The stuck ranks the others wait for (see [Note: which rank a timeout names]); empty when no
    rank is behind the others."""
    waiting = [r for r in stuck if _waits_in_collective(stacks.get(r, ""))]
    behind = [r for r in stuck if r not in waiting and stacks.get(r, "").strip()]
    return behind if waiting and behind else []


def timeout_reason(stuck: list[int], stacks: dict[int, str], timeout: float) -> str:
    reason = f"no answer from rank(s) {stuck} within {timeout:g} s"
    behind = behind_ranks(stuck, stacks)
    if behind:
        waiting = [r for r in stuck if r not in behind]
        where = innermost_frame(stacks.get(behind[0], ""))
        return (reason + f"; rank {behind[0]} is behind" + (f", at {where}" if where else "")
                + f" (rank(s) {waiting} wait for it in a collective)")
    where = innermost_frame(stacks.get(stuck[0], ""))
    return reason + (f"; rank {stuck[0]} at {where}" if where else "")
