"""Where a case's time goes on its ranks: seconds per phase of ``harness.compare.parity.run_case_on_rank``.

A rank's ``PhaseClock`` is lapped at the end of each phase, so the phases tile the rank's job from its
first step to its last with nothing counted twice:

- ``setup``: resolve the adapter, build the model, the unsupported check, the budget source, fault injection;
- ``reference``: the reference and its budgets, from the rank's cache or computed (on CUDA, until the
  device has drained its queue, which the engine's timing waits for anyway);
- ``build``: the engine's construction, ``torch.compile``'s wrapping included;
- ``steps``: training under the communication trace (a checkpointed case that resumes half-way counts its
  builds here: ``harness.compare.resume`` builds, saves, rebuilds and loads between its steps);
- ``observe``: what the harness reads from the engine between its steps for the comparison, carved out of
  ``steps`` (``PhaseClock.move``): each step's gradient pieces copied to the host with their norm gathered
  over the ranks, and the final parameters (``harness.compare.training.observing``; on CUDA a read that waits
  for kernels the step queued counts that wait here: a synchronization to separate them would hide engines'
  stream races);
- ``compare``: the tolerance policy and ``compare_observations``;
- ``knobs``: the knob checks (which rerun a short prefetch baseline or an offload probe for the cases that set
  those knobs);
- ``determinism``: the second run of a ``check_determinism`` case.

The record keeps the busiest rank's phases (``busiest``: the rank whose job took longest, which the round
trip waited for; as ``harness perf`` keeps each step's slowest rank's), so they add up to no more than the
case's round trip, and ``handoff_s``: what the round trip took beyond them. Plain data, no torch: the collect
stage reads it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

__all__ = ["BEFORE_JOB", "PHASES", "TIMING_DETAIL", "PhaseClock", "add_phases", "before_job_s", "busiest", "handoff_s"]

#: the keys of a record's ``detail`` that time what a case waited for before its job was sent, outside its
#: ``wall_s``: its pool's start (a pool starts on its first job) and its GPU slots (``harness.ranks.gpu_slots``).
BEFORE_JOB: tuple[str, ...] = ("pool_start_s", "slot_wait_s")

#: the keys of a record's ``detail`` that are measured times, not results: two runs of one case may differ in them
#: (and in ``runs``, each run's wall time) and in nothing else.
TIMING_DETAIL: tuple[str, ...] = ("engine_s", "reference_s", "phases_s", "handoff_s", *BEFORE_JOB, "runs")

#: the phases of one case on one rank, in the order they run.
PHASES: tuple[str, ...] = ("setup", "reference", "build", "steps", "observe", "compare", "knobs", "determinism")


class PhaseClock:
    """Laps of ``time.perf_counter``: ``lap(phase)`` adds the seconds since the previous lap (or since the clock
    was made) to ``phase``. ``seconds`` holds every phase, those that did not run at 0."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if phase not in self.seconds:
            raise ValueError(f"PhaseClock.lap: phase={phase!r} is not one of {list(PHASES)}")
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def move(self, seconds: float, source: str, target: str) -> None:
        """Count ``seconds`` of ``source``'s laps as ``target``'s: time measured inside a phase that belongs to
        another (the observation reads between the engine's steps)."""
        for phase in (source, target):
            if phase not in self.seconds:
                raise ValueError(f"PhaseClock.move: phase={phase!r} is not one of {list(PHASES)}")
        if not 0 <= seconds <= self.seconds[source] + 1e-9:
            raise ValueError(f"PhaseClock.move: seconds={seconds} must be within {source}'s {self.seconds[source]}")
        moved = min(seconds, self.seconds[source])
        self.seconds[source] -= moved
        self.seconds[target] += moved


def busiest(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The phases of the rank whose job took longest (the first of a tie). Not each phase's slowest rank: ranks
    wait for each other in collectives, so a skew between them would count in two phases, and the phases
    would add up to more than the round trip that enclosed every rank's job."""
    ranks = [{phase: float(r.get(phase, 0.0)) for phase in PHASES} for r in per_rank]
    return max(ranks, key=lambda r: sum(r.values()), default=dict.fromkeys(PHASES, 0.0))


def handoff_s(wall_s: float, per_rank: Sequence[Mapping[str, float]]) -> float:
    """The pool's round trip (``wall_s``) less the busiest rank's phases: sending and pickling the job, the
    answers coming back, and the wait for the slowest rank before the first phase starts.

    Never negative: the round trip and the phases are read on different clocks (the parent's monotonic,
    each rank's perf_counter) with a few microseconds of rounding between them, and a case whose whole
    time is its phases has a hand-off of 0, not of minus that rounding."""
    return max(wall_s - sum(busiest(per_rank).values()), 0.0)


def add_phases(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per phase the seconds of several runs of one case together (a repeated case's record)."""
    return {phase: sum(float(r.get(phase, 0.0)) for r in runs) for phase in PHASES}


def before_job_s(detail: Mapping[str, float]) -> float:
    """Seconds a record's case waited before its job was sent (``BEFORE_JOB``), which its ``wall_s`` leaves out."""
    return sum(float(detail.get(key, 0.0)) for key in BEFORE_JOB)
