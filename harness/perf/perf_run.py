"""The training-step benchmark's parent side: what runs, in which order, and the rows it yields.

``run`` trains every planned ``(engine, strategy)`` on one persistent rank pool (``harness.perf.benchmark``
holds the rank side) and turns the ranks' answers into ``PerfRow``s; everything else here is plain
functions over plain data: the plan, a row from the ranks' values (the slowest rank per step, the median
and spread over steps, tokens/s, TFLOP/s by the 6N rule, peak allocated and reserved memory), the ratio
of every row to torch FSDP1 with the same strategy measured in the same run, and the table.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.perf.benchmark import (
    ENGINES,
    STRATEGIES,
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

#: the engine every ratio is taken against.
BASELINE = "torch-fsdp"
GIB = 1024**3
#: the zoo models of the host-bound mode: many units each (every layer, or every submodule, a unit).
ZOO_MODELS: tuple[str, ...] = ("transformer", "always_wrap", "gpt")


def tflops_per_gpu(params: int, tokens_per_rank: int, step_s: float) -> float:
    """Model TFLOP/s per GPU by the 6N rule (forward 2N, backward 4N per token)."""
    return 6 * params * tokens_per_rank / step_s / 1e12


@dataclass
class PerfRow:
    """One engine's line of the table."""

    engine: str
    strategy: str | None
    #: ``ok``, ``unsupported`` or the pool outcome (``error``, ``timeout``, ``crash``).
    status: str
    reason: str = ""
    #: the zoo model of the host-bound mode; empty for the benchmark GPT.
    model: str = ""
    #: median over the timed steps of the slowest rank's step time.
    step_ms: float | None = None
    #: spread of the slowest rank's step times: fastest, 10th and 90th percentile, slowest.
    min_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    max_ms: float | None = None
    #: host-bound mode: median over the timed steps of the busiest rank's process CPU time per step.
    cpu_ms: float | None = None
    #: host-bound mode: wrapping the model plus the first (lazy-init) step, the slowest rank's; paid per case.
    setup_ms: float | None = None
    #: largest rank's peak allocated / reserved GiB during training; None on CPU.
    peak_gib: float | None = None
    reserved_gib: float | None = None
    #: tokens per second of all ranks together, at the median step time.
    tokens_per_s: float | None = None
    tflops: float | None = None
    #: last step's loss, mean over ranks.
    final_loss: float | None = None
    #: this step time over torch FSDP1's with the same strategy (and model), same run.
    ratio: float | None = None
    #: whether the final loss is within the tolerance of torch FSDP1's; None without a baseline.
    loss_matches: bool | None = None
    #: every timed step (slowest rank), for the JSON.
    steps_ms: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        name = self.engine if self.strategy is None else f"{self.engine} {self.strategy}"
        return f"{self.model}: {name}" if self.model else name


def plan_runs(engines: Sequence[str], strategies: Sequence[str]) -> list[tuple[str, str | None]]:
    """``(engine, strategy)`` pairs in the order they run: per strategy, the engines; DDP once, last."""
    runs: list[tuple[str, str | None]] = [(e, s) for s in strategies for e in engines if e != "ddp"]
    if "ddp" in engines:
        runs.append(("ddp", None))
    return runs


def spread(values_ms: Sequence[float]) -> tuple[float, float, float, float]:
    """``(min, p10, p90, max)`` of step times (percentiles interpolated between the measured steps)."""
    if len(values_ms) == 1:
        return (values_ms[0],) * 4  # type: ignore[return-value]
    deciles = statistics.quantiles(values_ms, n=10, method="inclusive")
    return min(values_ms), deciles[0], deciles[-1], max(values_ms)


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
    return PerfRow(
        engine, strategy, "ok", model=model, step_ms=1000 * step_s, cpu_ms=1000 * statistics.median(cpu) if cpu else None,
        setup_ms=1000 * max(setup) if setup else None, min_ms=lo, p10_ms=p10, p90_ms=p90, max_ms=hi,
        peak_gib=max(peaks) / GIB if peaks else None, reserved_gib=max(reserved) / GIB if reserved else None,
        tokens_per_s=len(values) * tokens_per_rank / step_s if throughput else None,  # type: ignore[operator]
        tflops=tflops_per_gpu(params, tokens_per_rank, step_s) if throughput else None,  # type: ignore[arg-type]
        final_loss=statistics.fmean(v.losses[-1] for v in timings), steps_ms=steps_ms,
    )


def add_ratios(rows: Sequence[PerfRow], loss_rtol: float) -> None:
    """Fill every row's ratio and loss check against torch FSDP1 with the same model and strategy (DDP
    against FULL_SHARD, the anchors' FSDP1 configuration)."""
    baselines = {(r.model, r.strategy): r for r in rows if r.engine == BASELINE and r.status == "ok"}
    for row in rows:
        base = baselines.get((row.model, row.strategy if row.strategy is not None else "full_shard"))
        if base is None or row.status != "ok" or row.step_ms is None or base.step_ms is None:
            continue
        row.ratio = row.step_ms / base.step_ms
        assert row.final_loss is not None and base.final_loss is not None
        row.loss_matches = math.isclose(row.final_loss, base.final_loss, rel_tol=loss_rtol, abs_tol=0.0)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[PerfRow]) -> str:
    """The rows as a GitHub Markdown table (not-ok rows show their reason)."""
    from tabulate import tabulate

    body = []
    for r in rows:
        if r.status != "ok":
            body.append((r.label, r.status, *["-"] * 10, r.reason[:100]))
            continue
        match = "" if r.loss_matches is None else ("matches" if r.loss_matches else "DIFFERS")
        body.append((r.label, "ok", _fmt(r.step_ms, ".2f"), f"{_fmt(r.p10_ms, '.2f')}..{_fmt(r.p90_ms, '.2f')}", _fmt(r.cpu_ms, ".2f"), _fmt(r.setup_ms, ".0f"),
                     _fmt(r.peak_gib, ".1f"), _fmt(r.reserved_gib, ".1f"), _fmt(r.tokens_per_s, ".4g"),
                     _fmt(r.tflops, ".3g"), _fmt(r.final_loss, ".4f"), _fmt(r.ratio, ".3f"), match))
    headers = ("engine", "status", "step ms", "p10..p90 ms", "CPU ms", "setup ms", "peak alloc GiB", "reserved GiB", "tokens/s",
               "TFLOP/s/GPU", "final loss", f"x {BASELINE}", "loss")
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def ratio_lines(rows: Sequence[PerfRow]) -> list[str]:
    """The headline: our engine's step time over torch FSDP1's, per model and strategy."""
    lines = []
    for r in rows:
        where = f"{r.model}, {r.strategy}" if r.model else r.strategy
        if r.engine == "builtin" and r.ratio is not None:
            base = next(b for b in rows if b.engine == BASELINE and b.strategy == r.strategy and b.model == r.model)
            cpu = (f"; CPU time per step {r.cpu_ms / base.cpu_ms:.3f} ({r.cpu_ms:.2f} vs {base.cpu_ms:.2f} ms)"
                   if r.cpu_ms and base.cpu_ms else "")
            lines.append(f"ratio builtin / {BASELINE} step time ({where}): {r.ratio:.3f} "
                         f"({r.step_ms:.2f} ms vs {base.step_ms:.2f} ms, same run){cpu}")
        elif r.engine == "builtin" and r.status == "ok":
            lines.append(f"ratio builtin / {BASELINE} ({where}): not measured ({BASELINE} {r.strategy} did not run ok)")
    return lines


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
    #: a final loss further than this (relative) from torch FSDP1's fails the benchmark.
    loss_rtol: float = 1e-3
    #: where the Chrome traces go (None: none).
    profile_dir: str | None = None
    #: the host-bound mode: these zoo models instead of the GPT (empty: the GPT).
    zoo_models: list[str] = field(default_factory=list)
    #: with ``profile_dir`` in the zoo mode, also a cProfile dump per engine and rank.
    cprofile: bool = False

    def __post_init__(self) -> None:
        bad = [v for v in self.strategies if v not in STRATEGIES]
        if bad or not self.strategies:
            raise ValueError(f"PerfConfig.strategies={self.strategies}: choose one or more of {list(STRATEGIES)}")
        if not self.engines:
            raise ValueError(f"PerfConfig.engines is empty: choose one or more of {list(ENGINES)} or engine specs")
        from harness.engines.registry import check_engines

        # DDP is the reference run, not an engine of the registry.
        fsdp = [e for e in self.engines if e != "ddp"]
        if fsdp:
            check_engines(fsdp, "--engines")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"PerfConfig: steps={self.steps} must be >= 1 and warmup={self.warmup} >= 0")
        if self.zoo_models and "ddp" in self.engines:
            raise ValueError("PerfConfig.engines: ddp is a reference, not an engine adapter; drop it with zoo models")
        from harness.cases.models import zoo_names

        bad_models = [m for m in self.zoo_models if m not in zoo_names()]
        if bad_models:
            raise ValueError(f"PerfConfig.zoo_models={bad_models}: choose from {sorted(zoo_names())}")


def _jobs(config: PerfConfig) -> list[tuple[str, str | None, str, Any, Any]]:
    """``(engine, strategy, model, job function, job)`` in the order they run."""
    plan = plan_runs(config.engines, config.strategies)
    if not config.zoo_models:
        return [(e, s, "", perf_job, PerfJob(e, s, config.model, config.precision, config.warmup, config.steps,
                                                 config.seed, config.lr, config.profile_dir)) for e, s in plan]
    return [(e, s, m, zoo_job, ZooJob(e, m, str(s), config.precision, config.warmup, config.steps, config.seed,
                                      config.profile_dir, cprofile=config.cprofile))
            for m in config.zoo_models for e, s in plan]


def run(config: PerfConfig) -> tuple[list[PerfRow], str]:
    """Every planned run on one pool, in order, and the device the ranks ran on (asked of the ranks, so
    this process never touches the GPUs); raises ``PoolStartError`` when the ranks cannot start. One
    line per run goes to stderr as it ends, after a header line saying what they are (so in a log file
    no line of a run comes before a header)."""
    from harness.ranks.pool import PoolConfig, RankPool

    pool_config = PoolConfig(world_size=config.world_size, backend=config.backend, devices=config.devices,
                             case_timeout_s=config.timeout_s)
    gpt = not config.zoo_models
    params = count_params(config.model) if gpt else None
    tokens = config.model.tokens_per_rank if gpt else None
    rows: list[PerfRow] = []
    device = "?"
    jobs = _jobs(config)
    print(f"perf: {len(jobs)} run(s) of {config.steps} timed steps on {config.world_size} ranks ({config.backend}), "
          "one line per engine and strategy as it ends:", file=sys.stderr, flush=True)
    with RankPool(pool_config) as pool:
        for engine_name, strategy, model, fn, job in jobs:
            outcome = pool.run(fn, job)
            if outcome.status == "ok":
                first = outcome.values[0]
                device = first.device if isinstance(first, RankTiming) else device
                rows.append(row_from_values(engine_name, strategy, outcome.values, params, tokens, model))
            else:
                rows.append(PerfRow(engine_name, strategy, outcome.status, outcome.reason, model=model))
            print(f"  {rows[-1].label}: {rows[-1].status}"
                  + (f", {rows[-1].step_ms:.2f} ms/step" if rows[-1].step_ms is not None else ""),
                  file=sys.stderr, flush=True)
    add_ratios(rows, config.loss_rtol)
    return rows, device
