"""The forkserver CPU pools fork their ranks from: what it imports, which pools use it, and its early start.

A spawned rank is a new Python that imports torch and the parity stack (about 2 s a rank on 2 cores, at every
pool start and respawn). A CPU pool's ranks fork from a forkserver that imported them once
(``FORKSERVER_PRELOAD``), one per process. The server imports for seconds before its first fork; a command
that will start CPU pools starts it first thing (``start_early``), so those imports run on another core while
the command imports its own. Torch-free, so that the command line can call it before it imports torch.
"""

from __future__ import annotations

import functools
import glob
import multiprocessing as mp
import os
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import util
from pathlib import Path
from typing import Any

__all__ = ["FORKSERVER_PRELOAD", "OWNER_MARK", "EARLY_COMMANDS", "context", "mark_multiprocessing_dir",
           "start_early", "start_method", "starts_early"]

#: what the forkserver imports once. Imports that ask CUDA nothing: a device count or a context made in the
#: server would be every forked rank's. DTensors, which the harness's modules import only where they use them
#: (a command needs none), are what most ranks use: their state dicts, torch FSDP2.
FORKSERVER_PRELOAD: tuple[str, ...] = ("harness.ranks.rank_process", "harness.compare.parity",
                                       "torch.distributed.tensor")
#: the name's start of the file that marks multiprocessing's directory of a process with pools, its pid after it.
OWNER_MARK = "harness-owner-"
#: the ``python -m harness`` commands that run cases on pools of their own.
EARLY_COMMANDS = frozenset({"run", "nightly", "certify", "bench"})


def start_method(devices: tuple[int, ...] | None, available: Iterable[str] | None = None) -> str:
    """How a pool of ``devices`` (None: CPU) starts its ranks: forked from a forkserver for a CPU pool where
    the platform has one; spawned for a CUDA pool (measured on GPUs so; a forkserver holds no CUDA state
    either, but its ranks are not yet measured there) and where there is no forkserver."""
    methods = mp.get_all_start_methods() if available is None else list(available)
    return "forkserver" if devices is None and "forkserver" in methods else "spawn"


def mark_multiprocessing_dir() -> None:
    """Mark multiprocessing's directory of this process (``pymp-*``, named at random, holding a forkserver's
    socket) with this process's pid: multiprocessing removes it at exit, and the next run removes it where this
    one was killed (``harness.ranks.pool.remove_stale_pool_dirs``)."""
    (Path(util.get_temp_dir()) / f"{OWNER_MARK}{os.getpid()}").touch()


@functools.cache
def context() -> Any:
    """The forkserver context of this process, set up once: its imports, and multiprocessing's directory marked."""
    mark_multiprocessing_dir()
    forkserver = mp.get_context("forkserver")
    forkserver.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return forkserver


def starts_early(command: str, argv: Sequence[str], environ: Mapping[str, str], gpu_nodes: Sequence[str]) -> bool:
    """Whether ``python -m harness COMMAND ARGV`` starts the forkserver before its imports: a command that runs
    pools, whose pools will be CPU ones (``--device cpu``, no GPU visible: ``CUDA_VISIBLE_DEVICES`` empty, or no
    NVIDIA device node in ``gpu_nodes``), outside torchrun (whose ranks are its own processes). A wrong guess
    costs a server's imports or the overlap, never a result."""
    if command not in EARLY_COMMANDS or "LOCAL_RANK" in environ or start_method(None) != "forkserver":
        return False
    cpu = "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))
    return cpu or environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1") or not gpu_nodes


def start_early(command: str, argv: Sequence[str]) -> None:
    """Start this process's forkserver now where ``starts_early`` says its pools will use it."""
    if starts_early(command, argv, os.environ, glob.glob("/dev/nvidia[0-9]*")):
        context()
        mp_forkserver.ensure_running()
