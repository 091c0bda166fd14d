"""The benchmark's rows and what is said about them, as plain functions over plain data (no processes).

A ``PerfRow`` is one engine's line of the table (one strategy, and with ``--small`` one zoo model). With
``--repeats N`` every engine and strategy runs once per repetition, the engine order rotated each time
(``harness.perf.perf_run.plan_runs``); ``summarize`` folds the repetitions into one row per engine and
strategy: the median of the repetitions' step times (each already the median over its timed steps) with
their min..max, peak memory the largest of any repetition. Ratios are paired: taken per repetition
(both runs of the same repetition) and reported as the median of those ratios with their range, against
torch FSDP1 (``BASELINE``) and against the faster torch engine (``TORCH_ENGINES``: the one of torch FSDP1
and FSDP2 with the smaller median step time at the same strategy in this run; one that failed, ran out
of memory or was not run is never the faster). ``table``, ``ratio_lines`` and ``phase_table`` (each step's
forward, backward and optimizer, ``harness.perf.phases``) are what ``python -m harness perf`` prints.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from harness.perf.phases import STEP_PHASES, phase_ratios

#: the engine the first ratio is taken against (the anchors' FSDP1 configuration).
BASELINE = "torch-fsdp"
#: the torch engines the second ratio takes the faster of, in the order a tie goes.
TORCH_ENGINES: tuple[str, ...] = ("torch-fsdp", "torch-fsdp2")
GIB = 1024**3

#: ``(model, engine, strategy)``: what a row measures, the same in every repetition.
RowKey = tuple[str, str, str | None]


def tflops_per_gpu(params: int, tokens_per_rank: int, step_s: float) -> float:
    """Model TFLOP/s per GPU by the 6N rule (forward 2N, backward 4N per token)."""
    return 6 * params * tokens_per_rank / step_s / 1e12


@dataclass
class PerfRow:
    """One engine's line of the table: one run's, or the summary of ``repeats`` repetitions."""

    engine: str
    strategy: str | None
    #: ``ok``, ``unsupported`` or the pool outcome (``error``, ``timeout``, ``crash``); a summary is ``ok``
    #: only when every repetition was.
    status: str
    reason: str = ""
    #: the zoo model of the host-bound mode; empty for the benchmark GPT.
    model: str = ""
    #: median over the timed steps of the slowest rank's step time; of a summary, the median over the
    #: repetitions of theirs.
    step_ms: float | None = None
    #: spread of the slowest rank's step times (fastest, 10th and 90th percentile, slowest); of a summary
    #: of several repetitions, the spread of the repetitions' step times.
    min_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    max_ms: float | None = None
    #: host-bound mode: median over the timed steps of the busiest rank's process CPU time per step.
    cpu_ms: float | None = None
    #: host-bound mode: wrapping the model plus the first (lazy-init) step, the slowest rank's; paid per case.
    setup_ms: float | None = None
    #: largest rank's peak allocated / reserved GiB during training (of a summary: of any repetition); None on CPU.
    peak_gib: float | None = None
    reserved_gib: float | None = None
    #: tokens per second of all ranks together, at the median step time.
    tokens_per_s: float | None = None
    tflops: float | None = None
    #: last step's loss, mean over ranks (of a summary: the median over the repetitions).
    final_loss: float | None = None
    #: this step time over torch FSDP1's with the same strategy (and model), same run; of a summary the
    #: median of the per-repetition ratios, ``ratio_min``..``ratio_max`` their range.
    ratio: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    #: whether the final loss is within the tolerance of torch FSDP1's (in every repetition); None without a baseline.
    loss_matches: bool | None = None
    #: the faster torch engine with this strategy (and model) in this run, and the ratio against it as above.
    faster_torch: str | None = None
    faster_ratio: float | None = None
    faster_ratio_min: float | None = None
    faster_ratio_max: float | None = None
    #: how many repetitions this row summarizes (1: one run's row).
    repeats: int = 1
    #: every timed step (slowest rank), for the JSON; of a summary, every repetition's in turn.
    steps_ms: list[float] = field(default_factory=list)
    #: ``{phase: ms}`` (``STEP_PHASES``): each phase's median over the timed steps, the phases of each step being
    #: its slowest rank's (the rank ``step_ms`` is of); of a summary the median over the repetitions. GPU
    #: time between CUDA events on GPUs, host time on CPU. None: the ranks did not split their steps.
    phase_ms: dict[str, float] | None = None
    #: median over the timed steps of each step's phases added up (of a summary, the median over the
    #: repetitions): at most ``step_ms``, the rest being host time outside the phases (the step's lead-in, the
    #: closing synchronize); the phases' medians need not add up to it.
    phase_sum_ms: float | None = None
    #: ``{phase: [ms of each timed step]}``, aligned with ``steps_ms``, for the JSON.
    steps_phase_ms: dict[str, list[float]] | None = None

    @property
    def key(self) -> RowKey:
        return (self.model, self.engine, self.strategy)

    @property
    def label(self) -> str:
        name = self.engine if self.strategy is None else f"{self.engine} {self.strategy}"
        return f"{self.model}: {name}" if self.model else name


def spread(values_ms: Sequence[float]) -> tuple[float, float, float, float]:
    """``(min, p10, p90, max)`` of step times (percentiles interpolated between the measured values)."""
    if len(values_ms) == 1:
        return (values_ms[0],) * 4  # type: ignore[return-value]
    deciles = statistics.quantiles(values_ms, n=10, method="inclusive")
    return min(values_ms), deciles[0], deciles[-1], max(values_ms)


# ---------------------------------------------------------------------------------------------------
# Repetitions folded into one row


def summarize_row(runs: Sequence[PerfRow]) -> PerfRow:
    """One engine's and strategy's repetitions (in the order they ran) as one row: the median step time
    and its min..max over the repetitions, the largest peak memory, throughput at the median. A
    repetition that was not ok makes the summary not ok, its status and reason naming the repetition."""
    if not runs:
        raise ValueError("summarize_row: no repetitions")
    first, n = runs[0], len(runs)
    if n == 1:
        # The summary never shares a list or dict with the repetition's row it was made from.
        steps_phase = None if first.steps_phase_ms is None else {p: list(v) for p, v in first.steps_phase_ms.items()}
        return dataclasses.replace(first, steps_ms=list(first.steps_ms), steps_phase_ms=steps_phase,
                                   phase_ms=None if first.phase_ms is None else dict(first.phase_ms))
    if all(r.status == "unsupported" for r in runs):
        return PerfRow(first.engine, first.strategy, "unsupported", first.reason, model=first.model, repeats=n)
    for i, r in enumerate(runs):
        if r.status != "ok" or r.step_ms is None:
            return PerfRow(first.engine, first.strategy, r.status if r.status != "ok" else "error",
                           f"repetition {i + 1} of {n}: {r.reason or 'no step time'}", model=first.model, repeats=n)
    times = [r.step_ms for r in runs]  # type: ignore[misc]
    step = statistics.median(times)
    lo, p10, p90, hi = spread(times)  # type: ignore[arg-type]
    scale = first.step_ms / step  # type: ignore[operator]  # throughput scales with 1 / step time

    def largest(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    def middle(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    # A phase is summarized only when every repetition has it: a median of some repetitions would not
    # compare with the step time, which is all of them.
    split = all(r.phase_ms is not None and r.phase_sum_ms is not None for r in runs)
    phase_ms = {p: statistics.median(r.phase_ms[p] for r in runs) for p in STEP_PHASES} if split else None  # type: ignore[index]
    steps_phase_ms = ({p: [v for r in runs for v in (r.steps_phase_ms or {}).get(p, [])] for p in STEP_PHASES}
                      if split else None)
    return dataclasses.replace(
        first, step_ms=step, min_ms=lo, p10_ms=p10, p90_ms=p90, max_ms=hi, repeats=n,
        cpu_ms=middle([r.cpu_ms for r in runs]), setup_ms=middle([r.setup_ms for r in runs]),
        peak_gib=largest([r.peak_gib for r in runs]), reserved_gib=largest([r.reserved_gib for r in runs]),
        tokens_per_s=None if first.tokens_per_s is None else first.tokens_per_s * scale,
        tflops=None if first.tflops is None else first.tflops * scale,
        final_loss=middle([r.final_loss for r in runs]),
        ratio=None, ratio_min=None, ratio_max=None, loss_matches=None,
        faster_torch=None, faster_ratio=None, faster_ratio_min=None, faster_ratio_max=None,
        steps_ms=[s for r in runs for s in r.steps_ms], phase_ms=phase_ms, steps_phase_ms=steps_phase_ms,
        phase_sum_ms=statistics.median(r.phase_sum_ms for r in runs) if split else None,  # type: ignore[type-var]
    )


def summarize(repetitions: Sequence[Sequence[PerfRow]], loss_rtol: float | None) -> list[PerfRow]:
    """One row per engine and strategy (in the first repetition's order) from every repetition's rows,
    with the paired ratios (``add_paired_ratios``). Every repetition must hold the same runs."""
    if not repetitions:
        raise ValueError("summarize: no repetitions")
    order = [r.key for r in repetitions[0]]
    by_key: dict[RowKey, list[PerfRow]] = {k: [] for k in order}
    for i, rows in enumerate(repetitions):
        if Counter(r.key for r in rows) != Counter(order):
            raise ValueError(f"summarize: repetition {i + 1} ran {[r.label for r in rows]}, the first "
                             f"{[r.label for r in repetitions[0]]}")
        for r in rows:
            by_key[r.key].append(r)
    summary = [summarize_row(by_key[k]) for k in order]
    add_paired_ratios(summary, repetitions, loss_rtol)
    return summary


# ---------------------------------------------------------------------------------------------------
# Ratios: against torch FSDP1 and against the faster torch engine, paired per repetition


def faster_torch(rows: Sequence[PerfRow], model: str, strategy: str) -> str | None:
    """The torch engine (of ``TORCH_ENGINES``) with the smaller step time at ``strategy`` (and ``model``)
    among ``rows`` that ran ok; None when neither did. A tie goes to the first of ``TORCH_ENGINES``."""
    ok = [r for r in rows if r.engine in TORCH_ENGINES and r.model == model and r.strategy == strategy
          and r.status == "ok" and r.step_ms is not None]
    if not ok:
        return None
    return min(ok, key=lambda r: (r.step_ms, TORCH_ENGINES.index(r.engine))).engine


def paired_ratios(repetitions: Sequence[Mapping[RowKey, PerfRow]], key: RowKey, base: RowKey) -> list[float]:
    """``key``'s step time over ``base``'s in each repetition where both ran ok."""
    out = []
    for rows in repetitions:
        row, ref = rows.get(key), rows.get(base)
        if row is None or ref is None or row.status != "ok" or ref.status != "ok":
            continue
        if row.step_ms is not None and ref.step_ms:
            out.append(row.step_ms / ref.step_ms)
    return out


def _range(ratios: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else (None, None, None)


def add_paired_ratios(rows: Sequence[PerfRow], repetitions: Sequence[Sequence[PerfRow]], loss_rtol: float | None) -> None:
    """Fill every ok row's ratios from ``repetitions`` (the runs ``rows`` summarize): against torch FSDP1
    and against the faster torch engine (chosen on ``rows``) with the same model and strategy (DDP
    against FULL_SHARD, the anchors' configuration), each the median of the per-repetition ratios with
    their range; and the loss check against torch FSDP1 (it must hold in every repetition), unless
    ``loss_rtol`` is None (the host-cost mode: over no-op collectives the engines' losses need not agree)."""
    indexed = [{r.key: r for r in rep} for rep in repetitions]
    for row in rows:
        if row.status != "ok" or row.step_ms is None:
            continue
        strategy = row.strategy if row.strategy is not None else "full_shard"
        base = (row.model, BASELINE, strategy)
        row.ratio, row.ratio_min, row.ratio_max = _range(paired_ratios(indexed, row.key, base))
        if row.ratio is not None and loss_rtol is not None:
            pairs = [(rep[row.key], rep[base]) for rep in indexed if row.key in rep and base in rep]
            row.loss_matches = all(
                a.final_loss is not None and b.final_loss is not None
                and math.isclose(a.final_loss, b.final_loss, rel_tol=loss_rtol, abs_tol=0.0) for a, b in pairs)
        faster = faster_torch(rows, row.model, strategy)
        if faster is not None:
            ratios = paired_ratios(indexed, row.key, (row.model, faster, strategy))
            if ratios:
                row.faster_torch = faster
                row.faster_ratio, row.faster_ratio_min, row.faster_ratio_max = _range(ratios)


def add_ratios(rows: Sequence[PerfRow], loss_rtol: float | None) -> None:
    """One run's ratios (``add_paired_ratios`` with a single repetition)."""
    add_paired_ratios(rows, [rows], loss_rtol)


# ---------------------------------------------------------------------------------------------------
# What is printed


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[PerfRow]) -> str:
    """The rows as a GitHub Markdown table (not-ok rows show their reason). Rows summarizing several
    repetitions show the repetitions' min..max in place of the steps' p10..p90."""
    from tabulate import tabulate

    repeats = max((r.repeats for r in rows), default=1)
    body = []
    for r in rows:
        if r.status != "ok":
            body.append((r.label, r.status, *["-"] * 11, r.reason[:100]))
            continue
        match = "" if r.loss_matches is None else ("matches" if r.loss_matches else "DIFFERS")
        lo, hi = (r.min_ms, r.max_ms) if r.repeats > 1 else (r.p10_ms, r.p90_ms)
        faster = "-" if r.faster_ratio is None else f"{r.faster_ratio:.3f} ({r.faster_torch})"
        body.append((r.label, "ok", _fmt(r.step_ms, ".2f"), f"{_fmt(lo, '.2f')}..{_fmt(hi, '.2f')}", _fmt(r.cpu_ms, ".2f"),
                     _fmt(r.setup_ms, ".0f"), _fmt(r.peak_gib, ".1f"), _fmt(r.reserved_gib, ".1f"),
                     _fmt(r.tokens_per_s, ".4g"), _fmt(r.tflops, ".3g"), _fmt(r.final_loss, ".4f"), _fmt(r.ratio, ".3f"),
                     faster, match))
    step, span = ("step ms", "p10..p90 ms") if repeats == 1 else (f"step ms (median of {repeats})", f"min..max of {repeats} ms")
    headers = ("engine", "status", step, span, "CPU ms", "setup ms", "peak alloc GiB", "reserved GiB", "tokens/s",
               "TFLOP/s/GPU", "final loss", f"x {BASELINE}", "x faster torch", "loss")
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def _detail(ratio: float, lo: float | None, hi: float | None, repeats: int, ours: float, theirs: float) -> str:
    if repeats == 1:
        return f"{ratio:.3f} ({ours:.2f} ms vs {theirs:.2f} ms, same run)"
    return f"{ratio:.3f} (median of {repeats}; per-rep ratios {lo:.3f}..{hi:.3f}; {ours:.2f} vs {theirs:.2f} ms medians)"


def _torch_notes(rows: Sequence[PerfRow], model: str, strategy: str, skip: str | None = None) -> list[str]:
    """Why each torch engine other than ``skip`` is not a candidate for the faster one: not run, or its status."""
    notes = []
    for engine in TORCH_ENGINES:
        if engine == skip:
            continue
        row = next((r for r in rows if r.engine == engine and r.strategy == strategy and r.model == model), None)
        if row is None:
            notes.append(f"{engine} not run")
        elif row.status != "ok":
            why = f": {row.reason[:80]}" if row.reason else ""
            notes.append(f"{engine} {row.status}{why}")
    return notes


def ratio_lines(rows: Sequence[PerfRow]) -> list[str]:
    """The headline, per engine other than the torch ones and DDP, per model and strategy: its step time
    over torch FSDP1's and over the faster torch engine's (median and per-repetition range with
    several repetitions); a ratio whose torch run did not run ok says so instead."""
    lines = []
    for r in rows:
        if r.engine in TORCH_ENGINES or r.engine == "ddp" or r.status != "ok" or r.strategy is None or r.step_ms is None:
            continue
        where = f"{r.model}, {r.strategy}" if r.model else r.strategy
        base = next((b for b in rows if b.engine == BASELINE and b.strategy == r.strategy and b.model == r.model), None)
        if r.ratio is not None and base is not None and base.step_ms is not None:
            cpu = (f"; CPU time per step {r.cpu_ms / base.cpu_ms:.3f} ({r.cpu_ms:.2f} vs {base.cpu_ms:.2f} ms)"
                   if r.cpu_ms and base.cpu_ms else "")
            lines.append(f"ratio {r.engine} / {BASELINE} step time ({where}): "
                         f"{_detail(r.ratio, r.ratio_min, r.ratio_max, r.repeats, r.step_ms, base.step_ms)}{cpu}")
        else:
            why = "not run" if base is None else "did not run ok"
            lines.append(f"ratio {r.engine} / {BASELINE} ({where}): not measured ({BASELINE} {r.strategy} {why})")
        fast = next((b for b in rows if b.engine == r.faster_torch and b.strategy == r.strategy and b.model == r.model), None)
        if r.faster_ratio is not None and fast is not None and fast.step_ms is not None:
            notes = _torch_notes(rows, r.model, r.strategy, skip=fast.engine)
            lines.append(f"ratio {r.engine} / faster torch ({fast.engine}) step time ({where}): "
                         f"{_detail(r.faster_ratio, r.faster_ratio_min, r.faster_ratio_max, r.repeats, r.step_ms, fast.step_ms)}"
                         + (f"; {'; '.join(notes)}" if notes else ""))
        else:
            lines.append(f"ratio {r.engine} / faster torch ({where}): not measured (neither "
                         f"{' nor '.join(TORCH_ENGINES)} {r.strategy} ran ok: {'; '.join(_torch_notes(rows, r.model, r.strategy))})")
    return lines


def phase_table(rows: Sequence[PerfRow], clock: str) -> str:
    """The ok rows' median phase times (``PerfRow.phase_ms``) as a Markdown table under a caption naming
    ``clock`` (what a phase's time is: GPU or host), the median of the steps' phase sums next to the step
    time (the rest is host time outside the phases: the step's lead-in and the closing synchronize) and each
    phase over the faster torch engine's (same model and strategy, ratio of the medians); empty when no row
    has phases."""
    from tabulate import tabulate

    split = [r for r in rows if r.status == "ok" and r.phase_ms]
    if not split:
        return ""
    body = []
    for r in split:
        phases = r.phase_ms or {}
        faster = next((b for b in rows if b.engine == r.faster_torch and b.strategy == r.strategy and b.model == r.model
                       and b.status == "ok" and b.phase_ms), None)
        # Against itself (it is the faster torch engine) a ratio says nothing.
        if faster is not None and faster.engine == r.engine:
            faster = None
        ratios = phase_ratios(phases, faster.phase_ms) if faster is not None else {}  # type: ignore[arg-type]
        versus = "-" if not ratios or faster is None else (
            " / ".join(_fmt(ratios.get(p), ".3f") for p in STEP_PHASES) + f" ({faster.engine})")
        body.append((r.label, *[_fmt(phases.get(p), ".2f") for p in STEP_PHASES], _fmt(r.phase_sum_ms, ".2f"),
                     _fmt(r.step_ms, ".2f"), versus))
    headers = ("engine", *[f"{p} ms" for p in STEP_PHASES], "phases ms", "step ms", f"x faster torch: {' / '.join(STEP_PHASES)}")
    caption = f"phase ms (median over the timed steps, each step's slowest rank; {clock}):"
    return caption + "\n" + tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)
