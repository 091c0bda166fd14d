"""A persistent pool of rank processes: started and joined into a process group once, reused per case.

PyTorch's own harness spawns the ranks again for every test method, and pays process start, imports
and process-group set-up (seconds) each time. Here ``RankPool`` starts ``world_size`` processes once;
a case is a picklable job ``fn(ctx, payload)`` sent to every rank over a pipe, every rank answers
with its own result, and the parent decides for all of them.

The parent is the watchdog (a hung collective never returns, so a rank cannot time itself out):

- every rank answered: ``ok``; some raised: ``error`` (after the others answer too, or are stuck);
- no answer by the case timeout: ``timeout``; every rank's Python stack is taken (faulthandler on
  SIGUSR1, which works while a thread is blocked inside a collective), the pool is killed and is
  respawned before the next case;
- a rank process died: ``crash``, with its exit code or signal and the end of its stderr.

After a case in which a rank raised, the pool compares the collective sequence numbers of every
process group across ranks: a rank that left a collective unmatched would pair the next case's
collectives wrongly, so a mismatch respawns the pool too.

A CPU pool's ranks are forked from a forkserver that imported the rank side once (``harness.ranks.forkserver``),
so a start or respawn costs no Python, torch or parity-stack import; a CUDA pool's are spawned. Either way a rank
runs with the environment its pool's start hands it (``rank_environment``), not a process-wide change.
Ranks ignore SIGINT (Ctrl-C reaches the parent, whose ``close()`` kills them), die with the parent
(``PR_SET_PDEATHSIG`` on Linux; a forked rank with its forkserver, which exits with the owner), and write
stderr to a per-rank file whose tail a crash reports.
Rendezvous is a TCPStore the parent owns on a free port of 127.0.0.1, so concurrent pools (pytest-xdist
workers) never collide. Where the ranks run is ``harness.ranks.placement.place``'s to decide
(``PoolConfig.placed``): one GPU per rank for NCCL, ranks sharing GPUs for gloo, or the CPU. The rank
process's own side (its start and job loop) is ``harness.ranks.rank_process``.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection as mp_connection
from multiprocessing.reduction import ForkingPickler
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from harness.cases.models import registering_modules
from harness.ranks import forkserver, gpu_slots
from harness.ranks.placement import (Backend, BackendChoice, DeviceChoice, Lane, n_gpus, place, rank_visible_devices,
                                     xdist_worker)
from harness.ranks.rank import RankContext
from harness.ranks.rank_process import Boot, RankError, pid_alive, rank_main
from harness.ranks.stacks import describe_exit, last_line, timeout_reason

__all__ = [
    "PoolConfig",
    "PoolOutcome",
    "PoolStartError",
    "RankError",
    "RankPool",
    "rank_environment",
    "remove_stale_pool_dirs",
]

OutcomeStatus = Literal["ok", "error", "timeout", "crash"]

#: characters of a rank's stderr a crash keeps.
STDERR_TAIL = 4000

#: a pool's temporary directory is ``<tmp>/harness-pool-<owner pid>-<random>``.
POOL_DIR_PREFIX = "harness-pool-"

#: longest sleep of the owner's waits on its ranks. The kernel may hand a process-wide SIGINT to any
#: thread (the TCPStore's server thread, a lane); Python's handler then only flags it for the main
#: thread, which sees it once its wait returns: a wait as long as the case's timeout would hold Ctrl-C
#: that long.
WAIT_SLICE_S = 0.5


# ---------------------------------------------------------------------------------------------------
# Plain data


@dataclass(frozen=True)
class PoolConfig:
    """How to start a pool and how long to wait for it."""

    #: number of rank processes (one process group over all of them).
    world_size: int = 2
    #: ``gloo`` (CPU tensors, or CUDA tensors with ranks that may share a GPU) or ``nccl`` (one GPU per
    #: rank, ``devices`` required and distinct). ``harness.ranks.placement.place`` chooses it.
    backend: Backend = "gloo"
    #: CUDA device index of each rank (``len == world_size``; repeated where gloo ranks share a GPU); None
    #: runs on CPU (gloo only), with the GPUs hidden from the ranks (``rank_environment``) so a CPU pool is
    #: the same on a GPU host as on CI.
    devices: tuple[int, ...] | None = None
    #: how the ranks start (``multiprocessing``'s start method); None: ``start_method``'s choice for ``devices``.
    start_method: str | None = None
    #: a case with no answer from every rank after this many seconds is a ``timeout``.
    case_timeout_s: float = 300.0
    #: starting the processes and joining the process group must finish within this.
    start_timeout_s: float = 180.0
    #: after one rank raised, how long the others get to answer before they count as stuck.
    error_grace_s: float = 10.0
    #: how long to wait for the stack dumps of a timeout.
    stack_wait_s: float = 3.0
    #: intra-op threads per rank on CPU; None divides the cores among the ranks of every pytest-xdist
    #: worker (each worker runs its own pools at the same time).
    threads_per_rank: int | None = None
    #: the process group's own timeout; far above ``case_timeout_s`` so the watchdog acts first.
    pg_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"PoolConfig.world_size={self.world_size} must be at least 1")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"PoolConfig.backend={self.backend!r} must be 'gloo' or 'nccl'")
        if self.devices is not None and len(self.devices) != self.world_size:
            raise ValueError(
                f"PoolConfig.devices={self.devices} must name one device per rank (world_size={self.world_size})"
            )
        if self.backend == "nccl" and (self.devices is None or len(set(self.devices)) != len(self.devices)):
            raise ValueError(f"PoolConfig.backend='nccl' needs one distinct CUDA device per rank, not devices={self.devices} "
                             "(NCCL refuses two ranks on one GPU: use backend='gloo' to share)")

    @classmethod
    def placed(cls, world_size: int, backend: BackendChoice = "auto", device: DeviceChoice = "auto", **kwargs: Any) -> "PoolConfig":
        """A pool of ``world_size`` ranks where ``harness.ranks.placement.place`` puts it on this host (this
        pytest-xdist worker's GPUs); ``PlacementError`` says why it cannot run here."""
        lane = place(world_size, n_gpus(), backend, device, *xdist_worker())
        return cls(world_size=world_size, backend=lane.backend, devices=lane.devices, **kwargs)  # type: ignore[arg-type]

    @property
    def lane(self) -> Lane:
        """Where this pool runs, as the placement rule describes it (device, ranks per GPU)."""
        return Lane(self.world_size, self.backend, self.devices)


@dataclass
class PoolOutcome:
    """What one job produced on the pool's ranks."""

    status: OutcomeStatus
    #: each rank's return value; None where the rank raised or never answered.
    values: list[Any]
    #: one line: why it is not ``ok``.
    reason: str = ""
    #: ranks that raised.
    errors: dict[int, RankError] = field(default_factory=dict)
    #: Python stacks of every rank still alive when a timeout, crash or stuck error was declared.
    stacks: dict[int, str] = field(default_factory=dict)
    #: ranks that died: exit code (negative: killed by that signal).
    exit_codes: dict[int, int] = field(default_factory=dict)
    #: end of the stderr each dead rank wrote during the job.
    stderr_tails: dict[int, str] = field(default_factory=dict)
    #: seconds from sending the job to deciding the outcome.
    wall_s: float = 0.0
    #: True when the pool was killed after this job and will be respawned.
    pool_reset: bool = False
    #: seconds the job waited for its GPU slots before it was sent (``harness.ranks.gpu_slots``; not in ``wall_s``).
    slot_wait_s: float = 0.0
    #: seconds the pool took to start its ranks for this job (lazily, on a first job or after a reset; not in
    #: ``wall_s``): on a loaded GPU node, seconds of CUDA and process-group set-up.
    pool_start_s: float = 0.0


class PoolStartError(RuntimeError):
    """The rank processes could not be started or could not form a process group."""


# ---------------------------------------------------------------------------------------------------
# Process helpers


def rank_environment(devices: tuple[int, ...] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a pool's ranks start with: ``environ`` (the parent's now) with the GPUs
    ``rank_visible_devices`` gives ``devices`` (none for a CPU pool).

    A CPU pool must compute on CPU on any host: torch FSDP1 given a CPU module and no ``device_id`` moves it
    to the current accelerator by itself, and every rank would take GPU 0 (and pay CUDA's start-up). A rank
    takes this environment as its own before it asks CUDA anything (``rank_main``), so nothing process-wide
    changes in the parent (pools start from several threads) and a forked rank does not keep its server's."""
    env = dict(environ)
    value = rank_visible_devices(devices, env.get("CUDA_VISIBLE_DEVICES"))
    if value is not None:
        env["CUDA_VISIBLE_DEVICES"] = value
    return env


def kill_group(proc: Any) -> None:
    """SIGKILL rank process ``proc`` and its process group (a rank leads its own: ``rank_main``), dead
    rank or alive: what a job started outlives a rank that exited or was killed, holding its pipes."""
    if proc.pid is None:
        return
    if proc.is_alive():
        proc.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # no group left (or not yet its own: the rank itself was killed above)


def remove_stale_pool_dirs(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the pool directories under ``root`` (default: the temporary directory) whose owner
    process is gone, and multiprocessing's directories such an owner marked
    (``forkserver.mark_multiprocessing_dir``); returns them. A run killed by ``kill -9`` leaves its
    directories behind."""
    removed: list[Path] = []
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    try:
        candidates = [(p, p.name[len(POOL_DIR_PREFIX):]) for p in root.glob(f"{POOL_DIR_PREFIX}*-*")]
        mark = forkserver.OWNER_MARK
        candidates += [(m.parent, m.name[len(mark):]) for m in root.glob(f"pymp-*/{mark}*")]
    except OSError:
        return removed
    for path, named in candidates:
        owner = named.split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not pid_alive(int(owner)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------------
# Parent side


def _read_from(path: Path, offset: int, limit: int | None = None) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text[-limit:] if limit else text


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


_pool_ids = itertools.count()


class RankPool:
    """``world_size`` rank processes in one process group, reused for every job.

    Use as a context manager (or call ``close()``). Starts lazily on the first ``run``; after a
    timeout, crash or unhealthy error it is killed and respawned lazily before the next job.
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        #: how many times the ranks were (re)started.
        self.starts = 0
        self._procs: list[Any] = []
        self._conns: list[mp_connection.Connection] = []
        self._seq = 0
        remove_stale_pool_dirs()
        # The owner's pid in the name lets a later run remove what a killed one left (kill -9 runs no cleanup).
        self._dir = Path(tempfile.mkdtemp(prefix=f"{POOL_DIR_PREFIX}{os.getpid()}-"))
        self._store: dist.TCPStore | None = None
        self._id = f"{os.getpid()}-{next(_pool_ids)}"

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _paths(self, rank: int) -> tuple[Path, Path]:
        return self._dir / f"rank{rank}.stderr", self._dir / f"rank{rank}.stacks"

    def start(self) -> None:
        """Spawn the ranks and wait until they formed the process group."""
        if self._procs:
            self._kill()
        cfg = self.config
        if self._store is None:
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        prefix = f"pool{self._id}/gen{self.starts}"
        self.starts += 1
        method = cfg.start_method or forkserver.start_method(cfg.devices)
        context = forkserver.context() if method == "forkserver" else mp.get_context(method)
        environ = rank_environment(cfg.devices, os.environ)
        for rank in range(cfg.world_size):
            stderr_path, stacks_path = self._paths(rank)
            boot = Boot(rank, cfg, "127.0.0.1", self._store.port, prefix, str(stderr_path), str(stacks_path),
                        registering_modules(), environ, method)
            parent_conn, child_conn = context.Pipe()
            proc = context.Process(target=rank_main, args=(boot, child_conn), daemon=True, name=f"harness-rank{rank}")
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        deadline = time.monotonic() + cfg.start_timeout_s
        waiting = set(range(cfg.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            ready = mp_connection.wait(
                [self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting],
                timeout=min(max(remaining, 0), WAIT_SLICE_S),
            )
            if not ready and time.monotonic() >= deadline:
                self._fail_start(f"ranks {sorted(waiting)} did not join the process group within {cfg.start_timeout_s:.0f} s")
            for r in list(waiting):
                conn = self._conns[r]
                if conn in ready or conn.poll():
                    try:
                        conn.recv()
                    except (EOFError, OSError):
                        self._fail_start(f"rank {r} exited during start-up")
                    waiting.discard(r)
                elif self._procs[r].sentinel in ready:
                    self._fail_start(f"rank {r} exited during start-up with code {self._procs[r].exitcode}")

    def _fail_start(self, why: str) -> None:
        tails = {r: _read_from(self._paths(r)[0], 0, STDERR_TAIL) for r in range(self.config.world_size)}
        self._kill()
        detail = "\n".join(f"--- rank {r} stderr ---\n{t}" for r, t in tails.items() if t.strip())
        raise PoolStartError(f"RankPool: {why}\n{detail}")

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the pool's files."""
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0))
        self._kill()
        self._store = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill_ranks(self) -> None:
        """Kill the ranks now, from any thread: a job waiting on them ends as a crash, and the owner's
        ``close`` then removes the pool's files (how an interrupted run stops its pools at once)."""
        for proc in list(self._procs):
            kill_group(proc)

    def _kill(self) -> None:
        for proc in self._procs:
            kill_group(proc)
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs -----------------------------------------------------------------------------------------

    def run(self, fn: Callable[[RankContext, Any], Any], payload: Any, timeout_s: float | None = None) -> PoolOutcome:
        """Run ``fn(ctx, payload)`` on every rank; ``fn`` must be a module-level function (pickled by name).

        Under the GPU slots of a pytest-xdist run (``harness.ranks.gpu_slots``) the job first waits for its
        NCCL ranks' slots; its timeout counts from when it has them."""
        started = 0.0
        if not self.alive:
            t0 = time.monotonic()
            self.start()
            started = time.monotonic() - t0
        slots = gpu_slots.installed()
        if slots is None:
            outcome = self._run(fn, payload, timeout_s)
        else:
            with slots.hold(self.config.backend, self.config.devices) as waited:
                outcome = self._run(fn, payload, timeout_s)
            outcome.slot_wait_s = waited
        outcome.pool_start_s = started
        return outcome

    def _run(self, fn: Callable[[RankContext, Any], Any], payload: Any, timeout_s: float | None) -> PoolOutcome:
        cfg = self.config
        ws = cfg.world_size
        timeout = cfg.case_timeout_s if timeout_s is None else timeout_s
        self._seq += 1
        seq = self._seq
        offsets = {r: _size(self._paths(r)[0]) for r in range(ws)}
        start = time.monotonic()
        values: list[Any] = [None] * ws
        errors: dict[int, RankError] = {}
        died: set[int] = set()
        try:
            # Pickled once, before anything is sent: either every rank gets the job or none does.
            message = ForkingPickler.dumps(("run", seq, fn, payload))
        except Exception as exc:
            raise TypeError(
                f"RankPool.run: fn={fn!r} and its payload must be picklable (fn a module-level function): {exc}"
            ) from exc
        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, OSError):
                died.add(r)
        pending = set(range(ws)) - died
        deadline = start + timeout
        first_error_at: float | None = None
        while pending and not died:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + cfg.error_grace_s)
            if now >= limit:
                break
            ready = mp_connection.wait(
                [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                timeout=min(limit - now, WAIT_SLICE_S),
            )
            for r in list(pending):
                conn = self._conns[r]
                if conn in ready or conn.poll():
                    try:
                        kind, msg_seq, value = conn.recv()
                    except (EOFError, OSError):
                        died.add(r)
                        pending.discard(r)
                        continue
                    if msg_seq != seq:
                        continue  # a late answer to an earlier job; cannot happen after a reset
                    pending.discard(r)
                    if kind == "ok":
                        values[r] = value
                    else:
                        errors[r] = value
                        first_error_at = first_error_at or time.monotonic()
                elif self._procs[r].sentinel in ready:
                    died.add(r)
                    pending.discard(r)
        wall = time.monotonic() - start

        if died:
            return self._crash(died, values, errors, offsets, wall)
        if pending:
            stuck = sorted(pending)
            stacks = self._dump_stacks()
            self._kill()
            if errors:
                first = errors[min(errors)]
                reason = f"{first.line()} (ranks {stuck} then stuck, presumably in a collective)"
                return PoolOutcome("error", values, reason, errors, stacks, wall_s=wall, pool_reset=True)
            return PoolOutcome("timeout", values, timeout_reason(stuck, stacks, timeout), errors, stacks,
                               wall_s=wall, pool_reset=True)
        if errors:
            reset = not self._healthy()
            if reset:
                self._kill()
            first = errors[min(errors)]
            return PoolOutcome("error", values, first.line(), errors, wall_s=wall, pool_reset=reset)
        return PoolOutcome("ok", values, wall_s=wall)

    def _crash(
        self, died: set[int], values: list[Any], errors: dict[int, RankError], offsets: dict[int, int], wall: float
    ) -> PoolOutcome:
        # Give the dead a moment to be reaped so their exit codes are known.
        for r in died:
            self._procs[r].join(timeout=2.0)
        alive = [r for r, p in enumerate(self._procs) if p.is_alive()]
        stacks = self._dump_stacks(alive) if alive else {}
        exit_codes = {r: self._procs[r].exitcode if self._procs[r].exitcode is not None else -999 for r in sorted(died)}
        tails = {r: _read_from(self._paths(r)[0], offsets[r], STDERR_TAIL) for r in sorted(died)}
        self._kill()
        first = min(died)
        reason = f"rank {first} {describe_exit(exit_codes[first])}"
        last = last_line(tails[first])
        if last:
            reason += f": {last}"
        return PoolOutcome("crash", values, reason, errors, stacks, exit_codes, tails, wall_s=wall, pool_reset=True)

    def _dump_stacks(self, ranks: list[int] | None = None) -> dict[int, str]:
        """Every (given) live rank's Python stacks, via faulthandler on SIGUSR1."""
        ranks = [r for r, p in enumerate(self._procs) if p.is_alive()] if ranks is None else ranks
        sizes = {r: _size(self._paths(r)[1]) for r in ranks}
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.config.stack_wait_s
        last: dict[int, int] = {}
        while time.monotonic() < deadline:
            now = {r: _size(self._paths(r)[1]) for r in ranks}
            if all(now[r] > sizes[r] for r in ranks) and now == last:
                break  # every rank wrote, and nothing grew since the last look
            last = now
            time.sleep(0.05)
        return {r: _read_from(self._paths(r)[1], sizes[r]) for r in ranks}

    def _healthy(self) -> bool:
        """True when every rank answers and agrees on every group's collective sequence number."""
        self._seq += 1
        seq = self._seq
        answers: dict[int, dict[str, int]] = {}
        try:
            for conn in self._conns:
                conn.send(("health", seq))
            deadline = time.monotonic() + max(self.config.error_grace_s, 1.0)
            for r, conn in enumerate(self._conns):
                while True:
                    if not conn.poll(max(deadline - time.monotonic(), 0)):
                        return False
                    kind, msg_seq, value = conn.recv()
                    if msg_seq == seq:
                        break
                if kind != "health":
                    return False
                answers[r] = value
        except (EOFError, OSError):
            return False
        merged: dict[str, int] = {}
        for numbers in answers.values():
            for key, number in numbers.items():
                if merged.setdefault(key, number) != number:
                    return False
        return True
