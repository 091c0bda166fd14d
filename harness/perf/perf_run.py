"""The training-step benchmark's parent side: what runs, in which order, and the rows it yields.

``run_repetitions`` trains every planned ``(engine, strategy)`` once per repetition (``--repeats``) on one
persistent rank pool (``harness.perf.benchmark`` holds the rank side), or with ``host_cost`` in this process
over a fake process group (``harness.perf.host_cost.FakeWorld``, the same jobs), the engine order rotated each
repetition so drift hits all engines alike, and turns the ranks' answers into ``PerfRow``s; ``run`` folds
the repetitions into one row per engine and strategy (``harness.perf.perf_rows``: medians, spreads, paired
ratios). Everything else here is plain functions over plain data: the plan, a row from the ranks' values
(the slowest rank per step, the median and spread over steps, that rank's phases of each step and their
medians, tokens/s, TFLOP/s by the 6N rule, peak allocated and reserved memory), the configuration.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.perf.benchmark import (
    ENGINES,
    MODEL_ALONE,
    STRATEGIES,
    UNSHARDED,
    GPTConfig,
    PerfJob,
    PerfPrecision,
    RankAnswer,
    RankTiming,
    Unsupported,
    ZooJob,
    count_params,
    perf_job,
    zoo_job,
)
from harness.perf.perf_rows import BASELINE, GIB, PerfRow, add_ratios, spread, summarize, tflops_per_gpu
from harness.perf.phases import median_phase_sum, median_phases, phases_by_name, slowest_rank_phases

#: the zoo models of the host-bound mode: many units each (every layer, or every submodule, a unit).
ZOO_MODELS: tuple[str, ...] = ("transformer", "always_wrap", "gpt")


def plan_runs(engines: Sequence[str], strategies: Sequence[str], repetition: int = 0) -> list[tuple[str, str | None]]:
    """``(engine, strategy)`` pairs in the order they run in ``repetition`` (0-based): per strategy, the
    engines rotated left by ``repetition`` (so over as many repetitions as engines each engine runs in
    every position); the runs without a strategy (``UNSHARDED``: DDP, the model alone) once each, last."""
    fsdp = [e for e in engines if e not in UNSHARDED]
    if fsdp:
        k = repetition % len(fsdp)
        fsdp = fsdp[k:] + fsdp[:k]
    runs: list[tuple[str, str | None]] = [(e, s) for s in strategies for e in fsdp]
    runs += [(e, None) for e in UNSHARDED if e in engines]
    return runs


def row_from_values(engine: str, strategy: str | None, values: Sequence[RankAnswer], params: int | None,
                    tokens_per_rank: int | None, model: str = "") -> PerfRow:
    """A row from every rank's ``perf_job``/``zoo_job`` answer (``params``/``tokens_per_rank`` None: no
    throughput columns, the zoo models' tokens are not comparable)."""
    unsupported = [v for v in values if isinstance(v, Unsupported)]
    if unsupported:
        return PerfRow(engine, strategy, "unsupported", unsupported[0].reason, model=model)
    timings = [v for v in values if isinstance(v, RankTiming)]
    if len(timings) != len(values):
        wrong = sorted({type(v).__name__ for v in values if not isinstance(v, RankTiming)})
        raise TypeError(f"row_from_values: ranks answered {wrong}; perf_job/zoo_job answer RankTiming or Unsupported")
    per_step_s = [max(steps) for steps in zip(*(v.step_s for v in timings))]
    step_s = statistics.median(per_step_s)
    steps_ms = [1000 * s for s in per_step_s]
    lo, p10, p90, hi = spread(steps_ms)
    peaks = [v.peak_bytes for v in timings if v.peak_bytes is not None]
    reserved = [v.reserved_bytes for v in timings if v.reserved_bytes is not None]
    throughput = params is not None and tokens_per_rank is not None
    cpu_steps = [v.cpu_s for v in timings if v.cpu_s is not None]
    cpu = [max(steps) for steps in zip(*cpu_steps)] if len(cpu_steps) == len(timings) else []
    setup = [v.setup_s for v in timings if v.setup_s is not None]
    phases: dict[str, list[float]] | None = None
    if all(v.phase_s is not None for v in timings):
        per_step = slowest_rank_phases([v.step_s for v in timings], [v.phase_s for v in timings])  # type: ignore[misc]
        phases = phases_by_name(per_step, scale=1000)
    return PerfRow(
        engine, strategy, "ok", model=model, step_ms=1000 * step_s, cpu_ms=1000 * statistics.median(cpu) if cpu else None,
        setup_ms=1000 * max(setup) if setup else None, min_ms=lo, p10_ms=p10, p90_ms=p90, max_ms=hi,
        peak_gib=max(peaks) / GIB if peaks else None, reserved_gib=max(reserved) / GIB if reserved else None,
        tokens_per_s=len(values) * tokens_per_rank / step_s if throughput else None,  # type: ignore[operator]
        tflops=tflops_per_gpu(params, tokens_per_rank, step_s) if throughput else None,  # type: ignore[arg-type]
        final_loss=statistics.fmean(v.losses[-1] for v in timings), steps_ms=steps_ms,
        phase_ms=median_phases(phases) if phases else None, steps_phase_ms=phases,
        phase_sum_ms=median_phase_sum(phases) if phases else None,
    )


@dataclass
class PerfConfig:
    """What one benchmark run trains."""

    model: GPTConfig
    #: engines to train, from ``ENGINES``.
    engines: list[str] = field(default_factory=lambda: ["builtin", BASELINE])
    #: sharding strategies of the FSDP engines, from ``STRATEGIES`` (DDP runs once).
    strategies: list[str] = field(default_factory=lambda: ["full_shard"])
    precision: PerfPrecision = "bf16"
    #: untimed steps first (allocator, NCCL communicators, autotuning).
    warmup: int = 3
    #: timed steps.
    steps: int = 10
    seed: int = 0
    lr: float = 3e-4
    world_size: int = 2
    #: ``nccl`` (one GPU per rank) or ``gloo`` (CPU, or ranks sharing GPUs).
    backend: Literal["gloo", "nccl"] = "gloo"
    #: the GPU of each rank (``harness.ranks.placement.place``); None on CPU.
    devices: tuple[int, ...] | None = None
    #: seconds one engine's run may take before it is a timeout.
    timeout_s: float = 300.0
    #: a final loss further than this (relative) from torch FSDP1's fails the benchmark; None: losses not
    #: compared (the host-cost mode, whose no-op collectives leave each engine's training its own).
    loss_rtol: float | None = 1e-3
    #: where the Chrome traces go (None: none).
    profile_dir: str | None = None
    #: the host-bound mode: these zoo models instead of the GPT (empty: the GPT).
    zoo_models: list[str] = field(default_factory=list)
    #: with ``profile_dir`` in the zoo mode, also a cProfile dump per engine and rank.
    cprofile: bool = False
    #: interleaved repetitions: each runs every engine and strategy once, the engine order rotated.
    repeats: int = 1
    #: the host-cost mode: the GPT's jobs in this process over a fake process group of ``world_size``
    #: (collectives are no-ops), each step timed in process time (``harness.perf.host_cost``).
    host_cost: bool = False

    def __post_init__(self) -> None:
        bad = [v for v in self.strategies if v not in STRATEGIES]
        if bad or not self.strategies:
            raise ValueError(f"PerfConfig.strategies={self.strategies}: choose one or more of {list(STRATEGIES)}")
        if not self.engines:
            raise ValueError(f"PerfConfig.engines is empty: choose one or more of {list(ENGINES)} or engine specs")
        from harness.engines.registry import check_engines

        # DDP and the model alone are references, not engines of the registry.
        fsdp = [e for e in self.engines if e not in UNSHARDED]
        if fsdp:
            check_engines(fsdp, "--engines")
        if self.repeats < 1:
            raise ValueError(f"PerfConfig.repeats={self.repeats} must be >= 1")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"PerfConfig: steps={self.steps} must be >= 1 and warmup={self.warmup} >= 0")
        if self.zoo_models and "ddp" in self.engines:
            raise ValueError("PerfConfig.engines: ddp is a reference, not an engine adapter; drop it with zoo models")
        from harness.cases.models import zoo_names

        bad_models = [m for m in self.zoo_models if m not in zoo_names()]
        if bad_models:
            raise ValueError(f"PerfConfig.zoo_models={bad_models}: choose from {sorted(zoo_names())}")
        self._check_host_cost()

    def _check_host_cost(self) -> None:
        """What the host-cost mode cannot measure of what the config holds, named by the command's options
        (the command refuses the placement options, which the config does not hold: ``--backend``,
        ``--device``, ``--size``)."""
        if not self.host_cost:
            if MODEL_ALONE in self.engines:
                raise ValueError(f"--engines {MODEL_ALONE}: the model alone is the baseline of --host-cost only "
                                 "(fp32 without autocast, it is no match for the engines' bf16 on ranks)")
            return
        if self.zoo_models:
            raise ValueError("--host-cost times the benchmark GPT (--layers, --d-model, ...); drop --small")
        if "ddp" in self.engines:
            raise ValueError("--host-cost: ddp cannot run over the fake process group (its reducer needs a real "
                             "all-reduce result); drop it from --engines")
        if self.cprofile:
            raise ValueError("--host-cost runs one process on the CPU over a fake process group: drop --cprofile "
                             "(its dumps go with --small and --profile)")
        if self.profile_dir is not None:
            raise ValueError("--host-cost: --profile's trace summaries are of collectives and GPU streams, of "
                             "which the fake process group has none; drop --profile")


def _jobs(config: PerfConfig, repetition: int = 0) -> list[tuple[str, str | None, str, Any, Any]]:
    """``(engine, strategy, model, job function, job)`` in the order they run in ``repetition``; only the
    first repetition is profiled (one trace per engine, strategy and rank)."""
    plan = plan_runs(config.engines, config.strategies, repetition)
    profile_dir = config.profile_dir if repetition == 0 else None
    if not config.zoo_models:
        return [(e, s, "", perf_job, PerfJob(e, s, config.model, config.precision, config.warmup, config.steps,
                                             config.seed, config.lr, profile_dir, host_cost=config.host_cost))
                for e, s in plan]
    return [(e, s, m, zoo_job, ZooJob(e, m, str(s), config.precision, config.warmup, config.steps, config.seed,
                                      profile_dir, cprofile=config.cprofile and profile_dir is not None))
            for m in config.zoo_models for e, s in plan]


def run_repetitions(config: PerfConfig) -> tuple[list[list[PerfRow]], str]:
    """Every repetition's rows (each in the order it ran, with that repetition's own ratios), all on one
    pool (with ``host_cost``, one fake process group in this process), and the device the ranks ran on
    (asked of the ranks, so this process never touches the GPUs); raises ``PoolStartError`` when the ranks
    cannot start. One line per run goes to stderr as it ends, after a header line saying what they are (so
    in a log file no line of a run comes before a header)."""
    from harness.ranks.pool import PoolConfig, RankPool

    world: Any
    if config.host_cost:
        from harness.perf.host_cost import FakeWorld

        world = FakeWorld(config.world_size)
        where = f"in this process over a fake process group of {config.world_size} ranks (no-op collectives)"
    else:
        world = RankPool(PoolConfig(world_size=config.world_size, backend=config.backend, devices=config.devices,
                                    case_timeout_s=config.timeout_s))
        where = f"on {config.world_size} ranks ({config.backend})"
    # No throughput from the zoo models (their tokens are not comparable) nor from process time over
    # no-op collectives (no training step's rate).
    gpt = not config.zoo_models and not config.host_cost
    params = count_params(config.model) if gpt else None
    tokens = config.model.tokens_per_rank if gpt else None
    repetitions: list[list[PerfRow]] = []
    device = "?"
    n_jobs = len(_jobs(config))
    runs = f"{n_jobs} run(s) of {config.steps} timed steps {where}"
    if config.repeats > 1:
        runs = f"{config.repeats} repetitions of {runs}, the engine order rotated each repetition"
    print(f"perf: {runs}, one line per engine and strategy as it ends:", file=sys.stderr, flush=True)
    with world as pool:
        for repetition in range(config.repeats):
            rows: list[PerfRow] = []
            prefix = f"rep {repetition + 1}/{config.repeats} " if config.repeats > 1 else ""
            for engine_name, strategy, model, fn, job in _jobs(config, repetition):
                outcome = pool.run(fn, job)
                if outcome.status == "ok":
                    first = outcome.values[0]
                    device = first.device if isinstance(first, RankTiming) else device
                    rows.append(row_from_values(engine_name, strategy, outcome.values, params, tokens, model))
                else:
                    rows.append(PerfRow(engine_name, strategy, outcome.status, outcome.reason, model=model))
                print(f"  {prefix}{rows[-1].label}: {rows[-1].status}"
                      + (f", {rows[-1].step_ms:.2f} ms/step" if rows[-1].step_ms is not None else ""),
                      file=sys.stderr, flush=True)
            add_ratios(rows, config.loss_rtol)
            repetitions.append(rows)
    return repetitions, device


def run(config: PerfConfig) -> tuple[list[PerfRow], str]:
    """``run_repetitions`` folded into one row per engine and strategy (``perf_rows.summarize``; with one
    repetition, that repetition's rows) and the device."""
    repetitions, device = run_repetitions(config)
    return summarize(repetitions, config.loss_rtol), device
