"""CUDA MPS for the rank processes of a run that share a GPU.

Without MPS a GPU runs one process's kernels at a time and switches between processes by time slice. A
nightly puts several pools on every GPU (``harness.ranks.placement.plan_lanes``), and at world size 4 a
collective needs all four GPUs to give its pool a turn at once: an NCCL kernel spins through its slice
waiting for peers whose process is not scheduled on their GPU. Under MPS the processes' kernels run side
by side. Measured on 4 H200s (``docs/measurements.md``, 2026-11-28, nightly samples on one machine): world
size 4 went from 2.8 to 9.5 cases/s, world size 2 from 8.4 to 12.0.

What runs: ``nvidia-cuda-mps-control -d`` with its pipes and logs in a directory of the harness's own (one
per user, under the temporary directory), so it never touches a daemon that the machine runs; the ranks find
it through ``CUDA_MPS_PIPE_DIRECTORY`` in the environment they start with. Runs side by side (pytest-xdist
workers that each run a nightly) share that daemon: each holds a shared lock on a file beside it while its
ranks run, and the last one out stops it. A daemon the user runs already (``CUDA_MPS_PIPE_DIRECTORY`` set,
or the system's pipe directory live) is used as it is and left running. A rank whose CUDA cannot reach a
daemon runs without MPS (the driver's own fallback), so ``auto`` never fails a run; ``on`` refuses to start
one where the daemon cannot run. MPS changes how kernels share a GPU, not what they compute: every verdict
and quantity is the same with and without it.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from harness.ranks.placement import Lane

__all__ = ["CONTROL", "MPS_CHOICES", "MPS_HELP", "MpsDaemon", "MpsError", "MpsState", "gpu_processes", "mps_wanted"]

MPS_CHOICES = ("auto", "on", "off")
#: ``--mps``'s help, less the default (each front end says its own).
MPS_HELP = ("CUDA MPS for rank processes that share a GPU (harness.ranks.mps): auto: on where pools or ranks share "
            "a GPU, off where the daemon cannot start; on: refused where it cannot; off: the GPUs time-slice the "
            "processes")
#: the daemon's command (NVIDIA's driver utilities).
CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
#: where a daemon started without ``CUDA_MPS_PIPE_DIRECTORY`` (the machine's) keeps its pipes.
SYSTEM_PIPE_DIR = Path("/tmp/nvidia-mps")
#: seconds a daemon command may take (the driver answers in milliseconds; a hung one must not hang a run).
COMMAND_TIMEOUT_S = 30.0


class MpsError(RuntimeError):
    """``--mps on`` where MPS cannot run; the message names the option and what to change."""


def gpu_processes(lanes: Iterable[Lane]) -> dict[int, int]:
    """Rank processes per GPU over ``lanes`` (pools side by side, ranks sharing a GPU); empty on CPU."""
    return dict(collections.Counter(d for lane in lanes for d in lane.devices or ()))


def mps_wanted(choice: str, lane_groups: Iterable[Iterable[Lane]]) -> tuple[bool, str]:
    """Whether a run wants MPS under ``--mps choice``, and why (or why not). ``lane_groups``: the lanes
    that run at once, one group after the other (``harness.run.runner.CaseRunner.run_all``'s world sizes)."""
    if choice not in MPS_CHOICES:
        raise ValueError(f"--mps: {choice!r} is not one of {list(MPS_CHOICES)}")
    counts = [n for group in lane_groups for n in gpu_processes(group).values()]
    if choice == "off":
        return False, "--mps off"
    if not counts:
        return False, "no rank of this run is on a GPU"
    most = max(counts)
    if choice == "auto" and most < 2:
        return False, "one rank process per GPU"
    return True, f"{most} rank processes on a GPU" if most > 1 else "one rank process per GPU"


@dataclass(frozen=True)
class MpsState:
    """What a run's ranks get: ``active`` (they start with a daemon to reach), in words how, and whether the
    run ``wanted`` MPS (pools or ranks share a GPU, or ``--mps on``): wanted and not active is worth a warning."""

    active: bool
    how: str
    wanted: bool = False

    def describe(self) -> str:
        """``CUDA MPS: on, the harness's daemon (/tmp/...); 8 rank processes on a GPU``."""
        return f"CUDA MPS: {self.how}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MpsDaemon:
    """A context manager over one run's pools: MPS for them while they run, as ``choice`` asks.

    Entering decides (``mps_wanted``), finds or starts the daemon and puts its directories into
    ``environ`` (the process's environment, which the pools copy when they start); leaving restores
    ``environ`` and stops a daemon of the harness's that no other run holds. ``lane_groups`` as for
    ``mps_wanted``; ``root``: where the harness's daemon directory goes (default: the temporary directory);
    ``control``: the daemon's command (default: ``CONTROL`` on PATH).
    """

    def __init__(self, choice: str, lane_groups: Iterable[Iterable[Lane]], *, environ: MutableMapping[str, str] | None = None,
                 root: Path | None = None, control: str | None = None) -> None:
        self.choice = choice
        self.lane_groups = [list(group) for group in lane_groups]
        self.environ = os.environ if environ is None else environ
        self.root = Path(tempfile.gettempdir()) if root is None else Path(root)
        self.control = control if control is not None else shutil.which(CONTROL)
        self.state = MpsState(False, "off: not entered")
        self._users: IO[str] | None = None
        self._env: dict[str, str] = {}
        self._home = self.root
        self._saved: dict[str, str | None] = {}

    # -- entering ---------------------------------------------------------------------------------------

    def __enter__(self) -> MpsState:
        wanted, why = mps_wanted(self.choice, self.lane_groups)
        if not wanted:
            if self.choice == "on":
                raise MpsError(f"--mps on: {why}; drop --mps on, or run on GPUs")
            self.state = MpsState(False, f"off: {why}")
        elif PIPE_ENV in self.environ:
            self.state = MpsState(True, f"on, the daemon of {PIPE_ENV}={self.environ[PIPE_ENV]} (the user's); {why}", True)
        elif (SYSTEM_PIPE_DIR / "control").exists():
            self.state = MpsState(True, f"on, the machine's daemon ({SYSTEM_PIPE_DIR}); {why}", True)
        else:
            self.state = self._own_daemon(why)
        return self.state

    def _without(self, reason: str) -> MpsState:
        if self.choice == "on":
            raise MpsError(f"--mps on: {reason}; pass --mps auto (runs without MPS) or --mps off")
        return MpsState(False, f"off: {reason}; the GPUs time-slice the ranks", True)

    def _own_daemon(self, why: str) -> MpsState:
        if self.control is None:
            return self._without(f"{CONTROL} is not on PATH (NVIDIA's driver utilities)")
        home = self.root / f"fsdp-parity-mps-{os.getuid()}"
        env = {PIPE_ENV: str(home / "pipe"), LOG_ENV: str(home / "log")}
        try:
            for d in (home, *map(Path, env.values())):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(home / "start.lock", "a", encoding="utf-8") as start:
                # One run at a time starts the daemon, or leaves it (``__exit__``), so that no run starts
                # a second daemon on the same pipes, or stops the one another run is about to use.
                fcntl.flock(start, fcntl.LOCK_EX)
                users = open(home / "users.lock", "a", encoding="utf-8")
                try:
                    if not self._alive(env):
                        started = self._command(["-d"], "", env)
                        if started is None or started.returncode != 0 or not self._alive(env):
                            users.close()
                            detail = (started.stderr or started.stdout).strip() if started is not None else "timed out"
                            return self._without(f"{CONTROL} -d did not start a daemon ({detail or 'no message'})")
                    # Held while this run's ranks run: the daemon's last user is the one that can lock it alone.
                    fcntl.flock(users, fcntl.LOCK_SH)
                except BaseException:
                    users.close()
                    raise
        except OSError as exc:
            return self._without(f"cannot use its directory {home} ({exc})")
        self._users, self._env, self._home = users, env, home
        self._saved = {k: self.environ.get(k) for k in env}
        self.environ.update(env)
        return MpsState(True, f"on, the harness's daemon ({home}); {why}", True)

    def _command(self, args: list[str], stdin: str, env: dict[str, str]) -> subprocess.CompletedProcess[str] | None:
        # The daemon sees every GPU: a server started under CUDA_VISIBLE_DEVICES renumbers the GPUs for its
        # clients, and the ranks name theirs as this process sees them (harness.ranks.placement).
        command_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | env
        try:
            return subprocess.run([str(self.control), *args], input=stdin, env=command_env,
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def _alive(self, env: dict[str, str]) -> bool:
        # The control command answers a query only through a running daemon's pipe.
        answer = self._command([], "get_server_list\n", env)
        return answer is not None and answer.returncode == 0

    # -- leaving ----------------------------------------------------------------------------------------

    def __exit__(self, *exc: object) -> None:
        for key, value in self._saved.items():
            if value is None:
                self.environ.pop(key, None)
            else:
                self.environ[key] = value
        users, self._users, self._saved = self._users, None, {}
        if users is None:
            return
        try:
            with open(self._home / "start.lock", "a", encoding="utf-8") as start:
                fcntl.flock(start, fcntl.LOCK_EX)
                try:
                    # Alone on the users' lock only when no other run holds the daemon: the last one out stops it.
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return
                self._command([], "quit\n", self._env)
        finally:
            users.close()
