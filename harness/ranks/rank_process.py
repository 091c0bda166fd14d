"""One rank process of a ``harness.ranks.pool.RankPool``: its start (placement on its device, the process
group over the pool's store) and its job loop. The parent side is ``harness.ranks.pool``."""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import importlib
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness.ranks.placement import rank_device_index, xdist_worker
from harness.ranks.rank import RankContext

__all__ = ["Boot", "KEEP_RESERVED_BYTES", "RankError", "die_with_parent", "launcher_environment", "pid_alive", "rank_main",
           "release_cached_memory", "serve"]


def launcher_environment(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank of a one-node job, which engines read (DeepSpeed asserts
    ``LOCAL_RANK``; our engine's default hybrid groups read ``LOCAL_WORLD_SIZE``). One node: the pool's
    ranks are all local, and the rendezvous is the pool's store."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


@dataclass
class RankError:
    """An exception a rank raised, as plain data."""

    rank: int
    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> "RankError":
        return cls(rank, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))

    def line(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"rank {self.rank}: {self.type}: {first}" if first else f"rank {self.rank}: {self.type}"


@dataclass(frozen=True)
class Boot:
    """Everything a rank process needs to start (picklable)."""

    rank: int
    #: the pool's ``harness.ranks.pool.PoolConfig`` (not imported: the pool imports this module).
    config: Any
    store_host: str
    store_port: int
    store_prefix: str
    stderr_path: str
    stacks_path: str
    #: modules the parent imported that register zoo models (``harness.cases.models.registering_modules``):
    #: a spawned rank imports them again, so a case can name those models.
    model_modules: tuple[str, ...] = ()
    #: the environment the rank runs with (``harness.ranks.pool.rank_environment``), taken before anything else.
    environ: dict[str, str] | None = None
    #: how the rank was started (``harness.ranks.forkserver.start_method``): a forked rank's parent is the
    #: forkserver.
    start_method: str = "spawn"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux): a pool's ranks when the pool's
    owner dies, a torchrun worker when its agent dies (torchrun leaves the workers of a SIGKILLed agent
    running). ``parent``: the pid that started this process, where it may have died already (a spawned
    rank imports torch before it gets here, and an orphan would then wait on the dead owner's store
    while holding its pipes); default: the parent now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect (the orphan has another parent now)
        os._exit(1)


def _leave_forkserver() -> None:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]  # a later use starts a server of its own


def rank_main(boot: Boot, conn: mp_connection.Connection) -> None:
    """Entry point of a rank process: join the group, then run jobs until told to stop."""
    if boot.environ is not None:
        os.environ.clear()
        os.environ.update(boot.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    owner = multiprocessing.parent_process().pid  # type: ignore[union-attr]  # a started child has one
    if boot.start_method == "forkserver":
        # The forkserver, this process's parent, exits once no process holds its "alive" pipe: the owner, and
        # each process forked from it, which inherits the pipe to use the server itself. A rank lets it go,
        # so the server exits with the owner, and dies with the server.
        _leave_forkserver()
        die_with_parent()
        if not pid_alive(owner):  # gone already: not a rank of anyone's
            os._exit(1)
    else:
        die_with_parent(owner)
    # A session (and process group) of its own, whose id is this pid: whatever a job starts (an engine's
    # forward may start a child) stays in it, and the pool kills the whole group with the rank
    # (``harness.ranks.pool.kill_group``), so nothing outlives the rank holding the run's pipes.
    os.setsid()
    # fd-level redirect so C++ (gloo, NCCL) messages land in the file too.
    err_fd = os.open(boot.stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err_fd, 2)
    stacks = open(boot.stacks_path, "a", buffering=1)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)

    cfg = boot.config
    os.environ.update(launcher_environment(boot.rank, cfg.world_size, boot.store_host, boot.store_port))
    if cfg.devices is not None:
        device = torch.device("cuda", rank_device_index(cfg.devices, boot.rank))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // (cfg.world_size * xdist_worker()[1])))
    store = dist.TCPStore(
        boot.store_host, boot.store_port, is_master=False, timeout=timedelta(seconds=cfg.start_timeout_s)
    )
    init_kwargs: dict[str, Any] = {}
    if cfg.backend == "nccl":
        init_kwargs["device_id"] = device  # eager init: sub-groups split from the world communicator
    dist.init_process_group(
        cfg.backend,
        store=dist.PrefixStore(boot.store_prefix, store),
        rank=boot.rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=cfg.pg_timeout_s),
        **init_kwargs,
    )
    for module in boot.model_modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a case naming its models then fails with build_model's message
            print(f"rank {boot.rank}: could not import {module} (it registers zoo models): {exc!r}", file=sys.stderr, flush=True)
    ctx = RankContext(boot.rank, cfg.world_size, boot.rank, cfg.world_size, cfg.backend, device)
    conn.send(("ready", boot.rank, os.getpid()))
    serve(ctx, conn)
    # No destroy_process_group: a peer may already be gone, and the parent kills stragglers anyway.
    os._exit(0)


def serve(ctx: RankContext, conn: mp_connection.Connection) -> None:
    """The rank's job loop: ``("run", seq, fn, payload)``, ``("health", seq)`` or ``("stop",)``."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        kind = msg[0]
        if kind == "stop":
            return
        seq = msg[1]
        if kind == "health":
            try:
                conn.send(("health", seq, ctx.sequence_numbers()))
            except Exception as exc:  # a backend without sequence numbers: the parent respawns
                conn.send(("raised", seq, RankError.from_exception(ctx.rank, exc)))
            continue
        _, _, fn, payload = msg
        del msg
        try:
            value = fn(ctx, payload)
            conn.send(("ok", seq, value))
        except BaseException as exc:  # noqa: BLE001 - every failure of a job is a result
            try:
                conn.send(("raised", seq, RankError.from_exception(ctx.rank, exc)))
            except Exception as send_exc:  # e.g. an unpicklable return value
                conn.send(("raised", seq, RankError.from_exception(ctx.rank, send_exc)))
        value = payload = None
        release_cached_memory(ctx.device)


#: reserved GPU memory a rank keeps between jobs; above it, the caching allocator's blocks go back to the
#: GPU. A pool lives for the whole run, and every idle rank on a GPU would otherwise keep the peak of its
#: largest case: DeepSpeed ZeRO-3 reserves about 6 GiB a rank (its default 5e8-element buckets) for the
#: zoo's small models, and under ``-n 16`` on 4 GPUs the idle pools of 16 workers filled a 140 GiB GPU
#: until the next case ran out of memory (``RANK_GPU_MEMORY`` in placement assumes 4 GiB a rank).
KEEP_RESERVED_BYTES = 1 << 30


def release_cached_memory(device: torch.device, keep_bytes: int = KEEP_RESERVED_BYTES) -> bool:
    """Return the caching allocator's free blocks to the GPU when ``device`` holds more than ``keep_bytes``
    reserved after a job (True when it did); a CPU rank has nothing to release."""
    if device.type != "cuda" or torch.cuda.memory_reserved(device) <= keep_bytes:
        return False
    gc.collect()  # the job's engine and model may sit in reference cycles still holding their tensors
    torch.cuda.empty_cache()
    return True


