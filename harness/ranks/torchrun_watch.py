"""The watchdog of cases run under torchrun, where no parent can kill a hung rank and the ranks may be on
several nodes: every rank beats a counter in torchrun's store (its own connection, so a main thread
blocked in the store cannot stop the beat), and rank 0 watches the beats and the case's clock.

- A rank whose beat stops for ``loss_s`` seconds is lost with its node: rank 0 records the case as
  ``crash`` naming the node (torchrun's ``GROUP_RANK``, its host and ranks); the stacks of the lost
  ranks are lost with it, and the reason says so.
- The case runs past its timeout: rank 0 records ``timeout`` with every live rank's stack, which each
  rank publishes in the store when asked (``harness.ranks.stacks.timeout_reason`` names the rank behind).
- The world group fails under a rank's feet (gloo raises when a peer's sockets close): that rank
  waits, and publishes its traceback as its stack; rank 0 waits for the loss to show in the beats and records
  ``crash``.

Then rank 0 marks the case ended in the store and every rank exits: the run ends (torchrun has no
world to go on with), the record is on disk (``--resume`` continues after the case). Ranks that lose
rank 0 (its node died, or the store with it) exit on their own after a bound. Workers of a lost agent
do not outlive it: ``harness.ranks.rank_process.die_with_parent``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from harness.ranks.stacks import timeout_reason

__all__ = ["Site", "TorchrunWatch", "site_of_this_rank", "lost_text"]

#: seconds between two beats of a rank.
BEAT_S = 1.0
#: seconds without a beat after which a rank is lost (a loaded host delays a beat by a second or two).
LOSS_S = 10.0
#: exit status of a rank whose case ended as a timeout (as ``timeout(1)``), else 1.
TIMEOUT_EXIT = 124


@dataclass(frozen=True)
class Site:
    """Where one rank of a torchrun run lives."""

    rank: int
    #: torchrun's node rank (``GROUP_RANK``): the order the nodes joined under c10d rendezvous.
    node: int
    host: str


def site_of_this_rank(rank: int) -> Site:
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return Site(rank, int(os.environ.get("GROUP_RANK", rank // max(1, local_ws))), socket.gethostname())


def lost_text(lost: list[int], sites: list[Site], loss_s: float) -> str:
    """``node 1 lost (host h, ranks [2, 3]): no heartbeat for 10 s; their stacks are lost with it``; a
    node some of whose ranks still beat is named as ``rank(s) [2] of node 1 (host h) lost``."""
    parts = []
    for node in sorted({sites[r].node for r in lost}):
        ranks = [r for r in lost if sites[r].node == node]
        host = sites[ranks[0]].host
        whole = ranks == [s.rank for s in sites if s.node == node]
        parts.append(f"node {node} lost (host {host}, ranks {ranks})" if whole
                     else f"rank(s) {ranks} of node {node} (host {host}) lost")
    return "; ".join(parts) + f": no heartbeat for {loss_s:g} s; their stacks are lost with it"


def _stack_of(thread: int | None) -> str:
    """A thread's stack in faulthandler's layout (innermost first), which ``harness.ranks.stacks`` reads."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return ""
    lines = [f"Current thread {thread:#018x} (most recent call first):"]
    lines += [f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in reversed(traceback.extract_stack(frame))]
    return "\n".join(lines) + "\n"


#: what rank 0 does with an ended case: ``(status, reason, stacks, exit codes)`` -> the record written.
OnEnd = Callable[[str, str, dict[int, str], dict[int, int]], None]


class TorchrunWatch:
    """One per rank for the run's life: ``with watch.case(name, on_end):`` around each case,
    ``world_failed`` when a world collective raised, ``close`` after the last case."""

    def __init__(self, rank: int, sites: list[Site], timeout_s: float,
                 beat_s: float = BEAT_S, loss_s: float = LOSS_S) -> None:
        self.rank, self.sites, self.timeout_s = rank, sites, timeout_s
        self.beat_s, self.loss_s = beat_s, loss_s
        self.world_size = len(sites)
        # torchrun's store (the agent's, at MASTER_ADDR:MASTER_PORT), on a connection of this thread's own.
        self.store = dist.PrefixStore("harness-watch/", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=max(loss_s, 30.0))))
        self._lock = threading.Lock()
        self._case: tuple[str, OnEnd | None, float] | None = None
        #: the thread that runs the cases (rank 0 runs them on a runner's lane): the stack that matters.
        self._case_thread = threading.main_thread().ident
        self._failed: tuple[float, str] | None = None
        self._published = False
        self._ending = False
        self._first_loss: float | None = None
        now = time.monotonic()
        self._beats: dict[int, tuple[int, float]] = {r: (-1, now) for r in range(self.world_size)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchrun-watch", daemon=True)
        self._thread.start()

    # -- main thread ---------------------------------------------------------------------------------

    def case(self, name: str, on_end: OnEnd | None) -> "_Case":
        """Watch case ``name``; ``on_end`` (rank 0's) records it if it ends badly."""
        return _Case(self, name, on_end)

    def world_failed(self, exc: BaseException) -> NoReturn:
        """A world collective raised: the group is gone. Never returns: this rank waits for rank 0 to
        record the case (rank 0 waits for the beats to say who was lost), then the process exits."""
        with self._lock:
            self._failed = (time.monotonic(), "".join(traceback.format_exception(exc)))
        while True:
            time.sleep(self.beat_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.beat_s)

    # -- the watch thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._tick()
            except RuntimeError as exc:  # torch's store errors: the store is gone, so is torchrun's agent 0
                self._exit(1, f"harness run: rank {self.rank}: torchrun's store is gone ({exc}); "
                              f"node {self.sites[0].node} (rank 0, which records) is presumably lost; exiting")

    def _tick(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        with self._lock:
            case, failed = self._case, self._failed
        now = time.monotonic()
        if self.rank != 0 and self.store.check(["ended"]):
            self._exit(1, "")
        # One request per run (the run ends with the case): a rank already in a later case answers too.
        if self.rank != 0 and not self._published and self.store.check(["dump"]):
            self._published = True
            self.store.set(f"stack/{self.rank}", failed[1] if failed else _stack_of(self._case_thread))
        if case is None:
            return
        _, _, started = case
        if self.rank != 0:
            # Rank 0 never ended the case: it is lost or stuck past its own watch.
            since = failed[0] if failed else started + self.timeout_s
            if now - since > 3 * self.loss_s:
                self._exit(TIMEOUT_EXIT, f"harness run: rank {self.rank}: rank 0 ended no case "
                                         f"{now - since:.0f} s after this one failed or timed out; exiting")
            return
        lost = self._lost(now)
        if not lost or self._first_loss is None:
            self._first_loss = now if lost else None  # a rank that beats again is not lost
        if lost:
            # The ranks of a lost node stopped beating within a beat of each other: wait for them all.
            if now - self._first_loss >= 2 * self.beat_s:
                self._end("crash", lost_text(lost, self.sites, self.loss_s), lost)
        # A rank lost when the group failed shows by now (its last beat came at most a beat after).
        elif failed and now - failed[0] > self.loss_s + 3 * self.beat_s:
            self._end("crash", f"the world group failed with no rank lost: {failed[1].strip().splitlines()[-1]}", [])
        elif now - started > self.timeout_s:
            self._end("timeout", "", [])

    def _lost(self, now: float) -> list[int]:
        lost = []
        for r in range(self.world_size):
            count = self.store.add(f"beat/{r}", 0)
            seen, since = self._beats[r]
            if count != seen:
                self._beats[r] = (count, now)
            elif now - since > self.loss_s:
                lost.append(r)
        return lost

    def _end(self, status: str, reason: str, lost: list[int]) -> None:
        """Rank 0: gather the live ranks' stacks, record the case, tell every rank, exit."""
        with self._lock:
            if self._case is None or self._ending:
                return
            self._ending = True
            name, on_end, _ = self._case
            failed = self._failed
        self.store.set("dump", name)
        stacks = {0: failed[1] if failed else _stack_of(self._case_thread)}
        waiting = [r for r in range(1, self.world_size) if r not in lost]
        deadline = time.monotonic() + self.loss_s
        while waiting and time.monotonic() < deadline:
            for r in [r for r in waiting if self.store.check([f"stack/{r}"])]:
                stacks[r] = self.store.get(f"stack/{r}").decode()
                waiting.remove(r)
            time.sleep(0.2)
        if status == "timeout":
            reason = timeout_reason(list(range(self.world_size)), stacks, self.timeout_s) + " under torchrun"
        if waiting:
            reason += f"; no stack from rank(s) {waiting}"
        if on_end is not None:
            try:
                on_end(status, reason + " (run ended)", stacks, {r: -999 for r in lost})
            except Exception as exc:  # the results file cannot take it: say so, and still end every rank
                reason += f"; not recorded: {exc}"
        self.store.set("ended", status)
        self._exit(TIMEOUT_EXIT if status == "timeout" else 1, f"harness run: {name} ended as {status}: {reason}")

    @staticmethod
    def _exit(code: int, message: str) -> NoReturn:
        if message:
            print(message, file=sys.stderr, flush=True)
        os._exit(code)


class _Case:
    def __init__(self, watch: TorchrunWatch, name: str, on_end: OnEnd | None) -> None:
        self.watch, self.name, self.on_end = watch, name, on_end

    def __enter__(self) -> "_Case":
        with self.watch._lock:
            self.watch._case = (self.name, self.on_end, time.monotonic())
            self.watch._case_thread = threading.get_ident()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.watch._lock:
            ending = self.watch._ending
            if not ending:
                self.watch._case = None
        while ending:  # rank 0's watch records this case and ends the process
            time.sleep(1.0)
