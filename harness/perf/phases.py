"""A timed step split into phases: forward (to the loss), backward, optimizer step with ``zero_grad``.

The profiler distorts what it measures (an engine slower by 1% untraced can be faster traced), so the
split is taken inside the timed steps themselves, with nothing added that waits: ``StepClock`` marks
each phase boundary as it is reached and is read only after the step's closing synchronize, which the
timed loop does anyway. On a GPU rank a mark is a CUDA event recorded on the current stream, so a phase
is the GPU's time from one boundary to the next (work of other streams counts where the current stream
waits on it, as the engines make it do before the loss, the optimizer and the next step); on a CPU rank a
mark is ``perf_counter`` (host time; process time in the host-cost mode). The rank side (``StepClock``)
and the plain functions that fold the ranks' phases into a row's (``slowest_rank_phases``,
``median_phases``) live here together so the GPT and the zoo jobs share one of each, and so does the
step that places the marks (``marked_step``). Not to be confused with ``harness.compare.phases``, the phases
of a parity case on its rank (setup, reference, build, steps, ...): those are host laps of a whole case,
these the GPU's (or host's) split of one training step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the phases of a step, in the order they run.
STEP_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


class StepClock:
    """The phase boundaries of one step at a time: ``start`` at the step's start, ``mark`` at the end of
    each phase, ``read`` after the step's closing synchronize. ``host_clock`` reads the host's time on a CPU
    rank: ``perf_counter`` (wall), or ``process_time`` where the step is timed in process time (the
    host-cost mode), so the phases are on the step's own clock and add up to no more than it."""

    def __init__(self, device: torch.device, host_clock: Callable[[], float] = time.perf_counter) -> None:
        import torch

        self._device = device
        self._host_clock = host_clock
        self._cuda = device.type == "cuda"
        n = len(STEP_PHASES) + 1
        # Made once and reused by every step: an event's first record creates it on the device, a cost
        # that then falls in the warm-up, never inside a timed step.
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if self._cuda else []
        self._host = [0.0] * n
        self._marked = 0

    def start(self) -> None:
        self._marked = 0
        self.mark()

    def mark(self) -> None:
        """The end of the current phase (the start of the next)."""
        if self._marked > len(STEP_PHASES):
            raise RuntimeError(f"StepClock: more than {len(STEP_PHASES)} marks after start ({', '.join(STEP_PHASES)})")
        if self._cuda:
            import torch

            self._events[self._marked].record(torch.cuda.current_stream(self._device))
        else:
            self._host[self._marked] = self._host_clock()
        self._marked += 1

    def read(self) -> list[float]:
        """Seconds of each phase of the last step, in ``STEP_PHASES`` order. On a GPU call it after the step's
        closing synchronize: ``elapsed_time`` of events not yet reached would wait or fail."""
        if self._marked != len(STEP_PHASES) + 1:
            raise RuntimeError(f"StepClock: {self._marked} marks since start, {len(STEP_PHASES) + 1} needed "
                               f"(start, then one after each of {', '.join(STEP_PHASES)})")
        if self._cuda:
            return [a.elapsed_time(b) / 1000 for a, b in zip(self._events, self._events[1:])]
        return [b - a for a, b in zip(self._host, self._host[1:])]


def no_mark() -> None:
    """The mark of steps whose phases are not read (the profiled ones): nothing at all."""


def marked_step(loss_of: Callable[[], torch.Tensor], run_backward: Callable[[torch.Tensor], None],
                optimizer: torch.optim.Optimizer, mark: Callable[[], None] = no_mark) -> torch.Tensor:
    """One training step with ``mark`` after each of ``STEP_PHASES``: the loss (``loss_of``, the forward),
    ``run_backward``, the optimizer step with ``zero_grad``. Every timed job steps through this, so a
    phase means the same in each."""
    loss = loss_of()
    mark()
    run_backward(loss)
    mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()
    return loss.detach()


# ---------------------------------------------------------------------------------------------------
# Plain functions: the ranks' phases folded into a row's


def slowest_rank_phases(step_s: Sequence[Sequence[float]], phase_s: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Per timed step, the phases of the rank whose step took longest (``step_s[rank][step]``,
    ``phase_s[rank][step][phase]``): that rank's step time is the one the row reports, so its phases are the
    ones that add up to it (a per-phase maximum over ranks could mix ranks and exceed the step). A tie goes
    to the lower rank."""
    if len(step_s) != len(phase_s):
        raise ValueError(f"slowest_rank_phases: {len(step_s)} ranks' step times, {len(phase_s)} ranks' phases")
    steps = min((len(s) for s in step_s), default=0)
    if any(len(p) != len(s) for s, p in zip(step_s, phase_s)):
        raise ValueError("slowest_rank_phases: a rank's phases and step times count different steps")
    out = []
    for i in range(steps):
        rank = max(range(len(step_s)), key=lambda r: (step_s[r][i], -r))
        out.append(list(phase_s[rank][i]))
    return out


def phases_by_name(per_step: Sequence[Sequence[float]], scale: float = 1.0) -> dict[str, list[float]]:
    """``{phase: [its time in step 0, step 1, ...]}`` from per-step phase lists (times ``scale``: 1000 for ms)."""
    if any(len(p) != len(STEP_PHASES) for p in per_step):
        raise ValueError(f"phases_by_name: every step needs {len(STEP_PHASES)} phases ({', '.join(STEP_PHASES)})")
    return {name: [scale * p[k] for p in per_step] for k, name in enumerate(STEP_PHASES)}


def median_phases(by_name: dict[str, list[float]]) -> dict[str, float]:
    """Each phase's median over the steps (each phase on its own: the medians need not add up to the
    median step, only about)."""
    return {name: statistics.median(values) for name, values in by_name.items() if values}


def median_phase_sum(by_name: dict[str, list[float]]) -> float:
    """The median over the steps of each step's phases added up. Unlike the sum of the phases' medians it
    is never above the median step time: every step's phases lie inside that step."""
    return statistics.median(sum(step) for step in zip(*by_name.values()))


def phase_ratios(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float]:
    """Each phase's time over the other run's, where the other's is positive."""
    return {name: ours[name] / theirs[name] for name in STEP_PHASES if name in ours and theirs.get(name)}
