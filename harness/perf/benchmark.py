"""The training-step benchmark's rank side: the GPT's sizes, the jobs every rank runs, their answers, the traces.

Two jobs, both run through ``harness.ranks.pool.RankPool`` (module-level functions, pickled by name):

- ``perf_job``: one engine trains the benchmark GPT (``harness.cases.models.BenchmarkGPT``: ``GPTBlock`` blocks
  without linear biases, token embedding, final norm, untied LM head) with every block a unit, AdamW,
  bf16 compute with fp32 reduction, and reports per-step seconds, losses, peak allocated and reserved
  memory. The device-bound regime: large models, where kernels and collectives dominate. The batches
  are the model's own (``get_input``), made before the timed loop.
- ``zoo_job``: one engine trains a small zoo model (``harness.cases.models``) built and wrapped exactly as
  the parity matrix does (``harness.engines.adapters``), and reports per-step wall seconds. The host-bound
  regime: tiny kernels, many units, where the engine's Python per step is the cost.

With ``PerfJob.host_cost`` (``python -m harness perf --host-cost``, run in one process over a fake
process group by ``harness.perf.host_cost``) ``perf_job`` times each step in process time with the
garbage collector off: the engines' host work per step, collectives being no-ops.

Both also split every timed step into forward, backward and optimizer (``harness.perf.phases``): CUDA
events on the current stream at the boundaries on GPUs, ``perf_counter`` on CPU ranks, read after the
step's closing synchronize, so the split adds no wait to the step it measures.

With a profile directory both also run a few extra steps after the timed ones under
``torch.profiler`` (CPU and, on GPUs, CUDA activities; shapes not recorded), each synchronized and marked
as the timed ones are, and write one Chrome trace per engine, strategy and rank; the timed steps are never
profiled. ``zoo_job`` can also write a
``cProfile`` dump of its timed steps, for the engine's Python hot spots.

Each rank answers a record, never a dict: ``RankTiming`` (its measurements) or ``Unsupported`` (why
the run is not measured); ``harness.perf.perf_run`` turns the ranks' answers into a row.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from harness.cases.models import CPU_GPT, BenchmarkGPT, GPTConfig, ZooModel, to_device, wrap_bottom_up
from harness.engines.optim import adamw, sgd
from harness.perf.phases import STEP_PHASES, StepClock, marked_step, no_mark
from harness.perf.profile_summary import STEP_MARK
from harness.ranks.rank import RankContext

PerfPrecision = Literal["bf16", "fp32"]
#: the host-cost mode's baseline: the model and AdamW with no wrapper at all (fp32, no autocast), the floor
#: every engine's host time per step adds to.
MODEL_ALONE = "model-alone"
ENGINES: tuple[str, ...] = ("builtin", "torch-fsdp", "torch-fsdp2", "ddp", MODEL_ALONE)
#: the runs without a sharding strategy: each runs once per repetition, not once per strategy.
UNSHARDED: tuple[str, ...] = ("ddp", MODEL_ALONE)
STRATEGIES: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
#: the fewest ranks a hybrid strategy is measured on: two shard groups of at least two ranks each,
#: else it degenerates into FULL_SHARD (one group) or DDP (groups of one).
HYBRID_MIN_RANKS = 4


#: steps run under the profiler after the timed ones (a trace covers this many steps).
PROFILE_STEPS = 3
#: the suffix of a CPU rank's peak memory beside its trace, and how many of its largest allocations it lists.
MEMORY_SUFFIX = ".memory.json"
MEMORY_LARGEST = 12


# ---------------------------------------------------------------------------------------------------
# The model's sizes


#: the named sizes of ``--size``. ``3b`` (2.91B parameters) halves the batch so DDP's and NO_SHARD's
#: replicated fp32 parameters, gradients and AdamW state (16 bytes a parameter) plus activations still
#: fit one 80 GiB GPU.
SIZES: dict[str, GPTConfig] = {
    "1b": GPTConfig(),
    "3b": GPTConfig(d_model=3072, layers=24, heads=24, batch=4),
}
#: small enough for two gloo ranks on two CPU cores (the zoo's ``perf_gpt``).
CPU_MODEL = CPU_GPT


def count_params(cfg: GPTConfig) -> int:
    """Parameters of ``BenchmarkGPT(cfg)``, without building it."""
    d = cfg.d_model
    block = 12 * d * d + 2 * 2 * d  # qkv, proj, two MLP linears; two LayerNorms (weight and bias)
    return cfg.layers * block + 2 * cfg.vocab * d + 2 * d


def unsupported_reason(engine: str, strategy: str | None, world_size: int) -> str | None:
    """Why ``(engine, strategy)`` is not measured on ``world_size`` ranks; None when it is."""
    if engine not in UNSHARDED:
        from harness.engines.fsdp2_adapter import FSDP2Adapter
        from harness.engines.registry import resolve

        adapter = resolve(engine)
        if isinstance(adapter, FSDP2Adapter) and strategy == "no_shard":
            return f"{adapter.name}: fully_shard always shards; NO_SHARD has no equivalent (DDP is the replicated run)"
        if adapter.fsdp1_module is None and not isinstance(adapter, FSDP2Adapter):
            return f"{adapter.name}: perf drives engines through torch FSDP1's or FSDP2's API; this adapter has neither"
    if strategy == "hybrid_shard" and world_size < HYBRID_MIN_RANKS:
        return (f"hybrid_shard needs at least {HYBRID_MIN_RANKS} ranks (two shard groups of two or more); "
                f"this run has {world_size}: rerun with --world-size {HYBRID_MIN_RANKS} on {HYBRID_MIN_RANKS}+ GPUs")
    return None


def trace_name(engine: str, strategy: str | None, rank: int, model: str = "gpt", suffix: str = "json") -> str:
    """File name of one rank's trace of one engine run: ``gpt-builtin-full_shard-rank0.json``."""
    return f"{model}-{engine}-{strategy or 'ddp'}-rank{rank}.{suffix}"


# ---------------------------------------------------------------------------------------------------
# What a rank answers


@dataclass(frozen=True)
class Unsupported:
    """A rank's answer when the engine or strategy is not measured on this run."""

    #: why, naming the engine, strategy or option and what to change.
    reason: str


@dataclass(frozen=True)
class RankTiming:
    """One rank's measurements of one engine's run (``perf_job`` and ``zoo_job``)."""

    #: wall seconds of each timed step (warm-up steps dropped).
    step_s: list[float]
    #: the loss of every step, warm-up included.
    losses: list[float]
    #: the GPU's name, or ``CPU``.
    device: str
    #: peak allocated / reserved bytes during training; None on CPU.
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    #: ``zoo_job``: this rank's process CPU seconds of each timed step.
    cpu_s: list[float] | None = None
    #: ``zoo_job``: seconds to wrap the model, and of the first (lazy-init) step.
    build_s: float | None = None
    first_step_s: float | None = None
    #: ``zoo_job``: sharded units, the root included.
    units: int | None = None
    #: where this rank's Chrome trace went (None: not profiled).
    trace: str | None = None
    #: seconds of each timed step's phases (``harness.perf.phases.STEP_PHASES`` order): GPU time between CUDA
    #: events on GPUs, host time on CPU; None from a rank that did not split its steps.
    phase_s: list[list[float]] | None = None

    @property
    def setup_s(self) -> float | None:
        """Wrapping plus the first step: what a parity case pays once (None: not measured)."""
        if self.build_s is None or self.first_step_s is None:
            return None
        return self.build_s + self.first_step_s


#: what ``perf_job`` and ``zoo_job`` return to the parent.
RankAnswer = RankTiming | Unsupported


# ---------------------------------------------------------------------------------------------------
# Rank side: the GPT


@dataclass(frozen=True)
class PerfJob:
    """One engine's run, as shipped to every rank."""

    engine: str
    #: sharding strategy; None for DDP.
    strategy: str | None
    model: GPTConfig
    precision: PerfPrecision
    warmup: int
    steps: int
    seed: int
    lr: float
    #: where the Chrome traces go (None: no profiling).
    profile_dir: str | None = None
    #: steps traced after the timed ones.
    profile_steps: int = PROFILE_STEPS
    #: time each step in process time (``time.process_time``), the garbage collector off across the steps:
    #: the host-cost mode, one process whose collectives are no-ops, where the step is host work alone.
    host_cost: bool = False


def _hybrid_shard_size(ctx: RankContext) -> int:
    from harness.ranks.placement import default_shard_size

    return default_shard_size(ctx.world_size, ctx.local_world_size)


def _fsdp1_wrap(namespace: Any, model: BenchmarkGPT, job: PerfJob, ctx: RankContext) -> nn.Module:
    """Every block its own unit, then the root, with the options FSDP1 is benchmarked with."""
    kwargs: dict[str, Any] = {
        "sharding_strategy": getattr(namespace.ShardingStrategy, str(job.strategy).upper()),
        "backward_prefetch": namespace.BackwardPrefetch.BACKWARD_PRE,
        "limit_all_gathers": True,
        "use_orig_params": True,
        "device_id": ctx.device,
    }
    if job.strategy == "hybrid_shard":
        kwargs["process_group"] = ctx.hybrid_groups(_hybrid_shard_size(ctx))
    if job.precision == "bf16":
        kwargs["mixed_precision"] = namespace.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return wrap_bottom_up(model, lambda module: namespace.FullyShardedDataParallel(module, **kwargs))


def _fsdp2_wrap(api: Any, model: BenchmarkGPT, job: PerfJob, ctx: RankContext) -> nn.Module:
    if job.strategy == "hybrid_shard":
        shard = _hybrid_shard_size(ctx)
        mesh = ctx.mesh((ctx.world_size // shard, shard), ("replicate", "shard"))
    else:
        mesh = ctx.mesh((ctx.world_size,), ("shard",))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": job.strategy != "shard_grad_op"}
    if job.precision == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return wrap_bottom_up(model, lambda module: api.fully_shard(module, **kwargs))


def _wrap(model: BenchmarkGPT, job: PerfJob, ctx: RankContext) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager[Any]]]:
    """The trained module and the context its forward runs in (autocast for DDP in bf16)."""
    if job.engine == MODEL_ALONE:
        return model, contextlib.nullcontext
    if job.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device_type == "cuda" else None)
        if job.precision == "bf16":
            return ddp, lambda: torch.autocast(ctx.device_type, dtype=torch.bfloat16)
        return ddp, contextlib.nullcontext
    import importlib

    from harness.engines.fsdp2_adapter import FSDP2Adapter
    from harness.engines.registry import resolve

    adapter = resolve(job.engine)
    if adapter.fsdp1_module is not None:
        return _fsdp1_wrap(importlib.import_module(adapter.fsdp1_module), model, job, ctx), contextlib.nullcontext
    if isinstance(adapter, FSDP2Adapter):
        return _fsdp2_wrap(adapter.api(), model, job, ctx), contextlib.nullcontext
    raise ValueError(f"perf: engine {adapter.name!r} has neither torch FSDP1's nor FSDP2's API")


def _batches(model: ZooModel, seed: int, steps: int, ctx: RankContext) -> list[tuple[torch.Tensor, ...]]:
    # Made before the timed loop and moved to the device: data loading is not what is measured.
    return [to_device(model.get_input(seed=seed, step=s, rank=ctx.rank), ctx.device) for s in range(steps)]


def _device_name(ctx: RankContext) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.device_type == "cuda" else "CPU"


def _sync(ctx: RankContext) -> None:
    if ctx.device_type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _release(ctx: RankContext) -> None:
    gc.collect()
    if ctx.device_type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _chrome_trace(ctx: RankContext, path: Path) -> Any:
    """Profile the enclosed steps (CPU, and CUDA on GPUs; no shapes) into a Chrome trace at ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device_type == "cuda" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, record_shapes=False) as prof:
        yield
    prof.export_chrome_trace(str(path))


def _profiled_steps(ctx: RankContext, path: Path, steps: int, step: Callable[[int, Callable[[], None]], object]) -> None:
    """Run ``steps`` steps under the profiler exactly as the timed ones run (synchronized before and after),
    each inside a ``STEP_MARK`` range, so the trace can split a step's time as the timer saw it. On CPU ranks,
    whose table has no peak memory, one more step's peak of live tensors goes beside the trace
    (``harness.perf.memory_peak``)."""
    from torch.profiler import record_function

    with _chrome_trace(ctx, path):
        for i in range(steps):
            _sync(ctx)
            with record_function(STEP_MARK):
                step(i, no_mark)
            _sync(ctx)
    if ctx.device_type == "cpu":
        _memory_step(path.with_suffix(MEMORY_SUFFIX), lambda mark: step(steps, mark))


def _memory_step(path: Path, step: Callable[[Callable[[], None]], object]) -> None:
    """One step under ``LiveStorages``, its phases named as ``marked_step`` marks them; the peak to ``path``."""
    from harness.perf.memory_peak import LiveStorages, largest

    phases = iter(STEP_PHASES[1:] + ("",))
    with LiveStorages() as live:
        live.phase = STEP_PHASES[0]

        def mark() -> None:
            live.phase = next(phases)

        step(mark)
    report = {"peak_bytes": live.peak_bytes, "peak_phase": live.peak_phase, "before_bytes": live.before_bytes,
              "largest": largest(live.at_peak, MEMORY_LARGEST)}
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _collector_off(off: bool) -> Any:
    """With ``off``, collect garbage now and keep the collector off inside: a collection's pause, which the
    engines' garbage triggers, would otherwise land in whichever engine's step it fell in (the host-cost
    mode's steps are a few ms, a full collection about as long)."""
    if not off:
        yield
        return
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def perf_job(ctx: RankContext, job: PerfJob) -> RankAnswer:
    """Train one engine on this rank: per-step seconds, per-step losses, peak allocated and reserved bytes."""
    reason = unsupported_reason(job.engine, job.strategy, ctx.world_size)
    if reason is not None:
        return Unsupported(reason)
    _release(ctx)
    # Built on the device under the same seed on every rank and for every engine: same start everywhere,
    # and no multi-GiB copy from the host.
    torch.manual_seed(job.seed)
    with torch.device(ctx.device):
        model = BenchmarkGPT(job.model)
    batches = _batches(model, job.seed, job.warmup + job.steps, ctx)
    module, forward_context = _wrap(model, job, ctx)
    optimizer = adamw(module.parameters(), lr=job.lr)

    def step(inputs: tuple[torch.Tensor, ...], mark: Callable[[], None] = no_mark) -> torch.Tensor:
        def loss_of() -> torch.Tensor:
            with forward_context():
                return model.get_loss(inputs, module(*inputs))

        return marked_step(loss_of, model.run_backward, optimizer, mark)

    _sync(ctx)
    if ctx.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    step_s: list[float] = []
    phase_s: list[list[float]] = []
    losses: list[torch.Tensor] = []
    # Process time counts this process's CPU seconds alone, not other work on a shared host's cores. In the
    # host-cost mode nothing waits (no GPU, no-op collectives), so that is the host's work per step.
    timer = time.process_time if job.host_cost else time.perf_counter
    clock = StepClock(ctx.device, host_clock=timer)
    with _collector_off(job.host_cost):
        for inputs in batches:
            _sync(ctx)
            t0 = timer()
            clock.start()
            loss = step(inputs, clock.mark)
            _sync(ctx)
            step_s.append(timer() - t0)
            phase_s.append(clock.read())
            losses.append(loss)
    cuda = ctx.device_type == "cuda"
    peak = torch.cuda.max_memory_allocated(ctx.device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(ctx.device) if cuda else None
    trace = None
    if job.profile_dir is not None:
        path = Path(job.profile_dir) / trace_name(job.engine, job.strategy, ctx.rank)
        _profiled_steps(ctx, path, job.profile_steps, lambda i, mark: step(batches[i % len(batches)], mark))
        trace = str(path)
    result = RankTiming(step_s=step_s[job.warmup:], losses=[float(x) for x in losses], device=_device_name(ctx),
                        peak_bytes=peak, reserved_bytes=reserved, trace=trace, phase_s=phase_s[job.warmup:])
    del module, model, optimizer, batches, losses, loss
    _release(ctx)
    return result


# ---------------------------------------------------------------------------------------------------
# Rank side: small zoo models (the host-bound regime)


@dataclass(frozen=True)
class ZooJob:
    """One engine training one zoo model the way the parity matrix builds it."""

    engine: str
    model: str
    strategy: str
    precision: str
    warmup: int
    steps: int
    seed: int = 0
    profile_dir: str | None = None
    profile_steps: int = PROFILE_STEPS
    #: write a cProfile dump of the timed steps next to the traces.
    cprofile: bool = False


def zoo_job(ctx: RankContext, job: ZooJob) -> RankAnswer:
    """Per-step wall seconds of one engine on one zoo model (no gradient reads, no trace hooks: the
    engine's own cost), and its final loss."""
    from harness.cases.case import CaseConfig
    from harness.cases.dtypes import dtype_of
    from harness.cases.models import build_model
    from harness.engines.registry import resolve

    reason = unsupported_reason(job.engine, job.strategy, ctx.world_size)
    if reason is not None:
        return Unsupported(reason)
    case = CaseConfig(engine=job.engine, model=job.model, sharding_strategy=job.strategy,  # type: ignore[arg-type]
                      precision=job.precision, world_size=ctx.world_size, seed=job.seed)  # type: ignore[arg-type]
    adapter = resolve(case.engine)
    full = dtype_of(case.precision_spec.full)
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size).to(full)
    reason = adapter.unsupported_reason(case, model, ctx)
    if reason is not None:
        return Unsupported(reason)
    _sync(ctx)
    t_build = time.perf_counter()
    trainee = adapter.build(case, model, ctx)
    _sync(ctx)
    build_s = time.perf_counter() - t_build
    zoo = trainee.zoo
    optimizer = sgd(trainee.trainable_parameters(), case.lr, case.momentum)
    batches = [to_device(zoo.get_input(seed=case.seed, step=s, rank=ctx.rank), ctx.device, full)
               for s in range(job.warmup + job.steps)]

    def step(inputs: tuple[torch.Tensor, ...], mark: Callable[[], None] = no_mark) -> torch.Tensor:
        return marked_step(lambda: zoo.get_loss(inputs, trainee.module(*inputs)), zoo.run_backward, optimizer, mark)

    step_s: list[float] = []
    # CPU seconds of this rank's process per step (its threads together): the host cost itself, less
    # blurred than wall time by ranks waiting on each other when the host's cores are shared.
    cpu_s: list[float] = []
    phase_s: list[list[float]] = []
    losses: list[float] = []
    clock = StepClock(ctx.device)
    profiler = cProfile.Profile() if job.cprofile else None
    for i, inputs in enumerate(batches):
        timed = i >= job.warmup
        _sync(ctx)
        if profiler is not None and timed:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        clock.start()
        loss = step(inputs, clock.mark)
        _sync(ctx)
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)
        if profiler is not None and timed:
            profiler.disable()
        phase_s.append(clock.read())
        losses.append(float(loss))
    trace = None
    if job.profile_dir is not None:
        directory = Path(job.profile_dir)
        if profiler is not None:
            directory.mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(directory / trace_name(job.engine, job.strategy, ctx.rank, job.model, "prof"))
        path = directory / trace_name(job.engine, job.strategy, ctx.rank, job.model)
        _profiled_steps(ctx, path, job.profile_steps, lambda i, mark: step(batches[i % len(batches)], mark))
        trace = str(path)
    # Wrapping and the first step (lazy init) are paid once per parity case: part of the host-bound cost.
    return RankTiming(step_s=step_s[job.warmup:], losses=losses, device=_device_name(ctx), cpu_s=cpu_s[job.warmup:],
                      build_s=build_s, first_step_s=step_s[0] if step_s else None,
                      units=len(zoo.wrap_units()) + 1, trace=trace, phase_s=phase_s[job.warmup:])
