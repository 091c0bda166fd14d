"""The ranks torchrun started, as a pool ``harness.run.runner.CaseRunner`` drives: one lane, the world.

Rank 0 runs the runner (it selects, records and shows progress); its lane's pool is this world.
``TorchrunWorld.run`` broadcasts the job to the other ranks, runs it on rank 0 too and gathers every
rank's answer into a ``harness.ranks.pool.PoolOutcome``, all under ``harness.ranks.torchrun_watch`` (a case past
its timeout or a lost node is recorded by ``record_lost`` and ends the run: there is no parent to
respawn ranks). The other ranks ``serve``: receive a job, run it under the watch, answer, until
rank 0 leaves the world (``close``, or the ``with`` block) and sends the stop.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from harness.ranks.pool import PoolOutcome
from harness.ranks.rank import RankContext
from harness.ranks.rank_process import RankError
from harness.ranks.torchrun_watch import TorchrunWatch

__all__ = ["TorchrunWorld"]

#: what the other ranks receive when rank 0 leaves the world.
_STOP = ("stop",)

#: rank 0's record of a job the watch ended (a timeout, a lost node): ``(payload, outcome)``.
RecordLost = Callable[[Any, PoolOutcome], None]


def _name(payload: Any) -> str:
    """The job's name in the watch's messages: a case's full id."""
    return str(getattr(payload, "full_id", payload))


class TorchrunWorld:
    """Every rank's view of the world for the run's life; rank 0 ``run``s jobs, the others ``serve``."""

    def __init__(self, ctx: RankContext, watch: TorchrunWatch, record_lost: RecordLost | None = None) -> None:
        self.ctx, self.watch = ctx, watch
        #: rank 0's: records a job the watch ended, before the process exits.
        self.record_lost = record_lost
        self._closed = False

    def __enter__(self) -> "TorchrunWorld":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Left by an exception (Ctrl-C reached every rank, or rank 0 failed and torchrun stops the rest), the
        # other ranks may be in a job's collectives: a stop would not match them.
        if exc_type is None:
            self.close()

    def run(self, fn: Callable[[RankContext, Any], Any], payload: Any, timeout_s: float | None = None) -> PoolOutcome:
        """Rank 0: ``fn(ctx, payload)`` on every rank of the world (``fn`` module-level: pickled by name).
        The watch's timeout is the run's (``--timeout``): ``timeout_s`` cannot change it here."""
        if self.ctx.rank != 0:
            raise RuntimeError(f"TorchrunWorld.run on rank {self.ctx.rank}: only rank 0 runs jobs; the others serve()")
        ws, t0 = self.ctx.world_size, time.monotonic()

        def ended(status: str, reason: str, stacks: dict[int, str], exit_codes: dict[int, int]) -> None:
            if self.record_lost is not None:
                self.record_lost(payload, PoolOutcome(status, [None] * ws, reason, stacks=stacks,  # type: ignore[arg-type]
                                                      exit_codes=exit_codes, wall_s=time.monotonic() - t0))

        with self.watch.case(_name(payload), ended):
            try:
                dist.broadcast_object_list([(fn, payload)], src=0)
            except Exception as exc:  # the world group is gone: the watch records the case and ends the run
                self.watch.world_failed(exc)
            gathered = self._answer(fn, payload)
        errors = {r: v for r, (kind, v) in enumerate(gathered) if kind == "raised"}
        values = [v if kind == "ok" else None for kind, v in gathered]
        reason = errors[min(errors)].line() if errors else ""
        return PoolOutcome("error" if errors else "ok", values, reason, errors, wall_s=time.monotonic() - t0)

    def serve(self) -> None:
        """Ranks > 0: run rank 0's jobs until it sends the stop."""
        while True:
            message: list[Any] = [None]
            try:
                dist.broadcast_object_list(message, src=0)
            except Exception as exc:  # rank 0's watch (or the store's loss) ends this rank
                self.watch.world_failed(exc)
            if message[0] == _STOP:
                return
            fn, payload = message[0]
            with self.watch.case(_name(payload), None):
                self._answer(fn, payload)

    def kill_ranks(self) -> None:
        """Nothing to kill: torchrun owns the ranks (Ctrl-C reaches them all through it)."""

    def close(self) -> None:
        """Rank 0: send the other ranks the stop (once)."""
        if self.ctx.rank == 0 and not self._closed:
            self._closed = True
            dist.broadcast_object_list([_STOP], src=0)

    def _answer(self, fn: Callable[[RankContext, Any], Any], payload: Any) -> list[Any]:
        """Run the job on this rank and gather every rank's answer on rank 0 (an empty list elsewhere)."""
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)  # per thread: rank 0 runs its jobs on a runner's lane
        try:
            answer: tuple[str, Any] = ("ok", fn(self.ctx, payload))
        except Exception as exc:  # every failure of a job is a result
            answer = ("raised", RankError.from_exception(self.ctx.rank, exc))
        gathered: list[Any] = [None] * self.ctx.world_size if self.ctx.rank == 0 else []
        try:
            dist.gather_object(answer, gathered if self.ctx.rank == 0 else None, dst=0)
        except Exception as exc:  # the world group is gone: the watch records the case and ends the run
            self.watch.world_failed(exc)
        return gathered
