"""The training-step benchmark's rank side: the GPT it trains, the jobs every rank runs, the traces.

Two jobs, both run through ``harness.pool.RankPool`` (module-level functions, pickled by name):

- ``perf_job``: one engine trains the benchmark GPT (``GPT``: ``harness.models.GPTBlock`` blocks
  without linear biases, token embedding, final norm, untied LM head) with every block a unit, AdamW,
  bf16 compute with fp32 reduction, and reports per-step seconds, losses, peak allocated and reserved
  memory. The device-bound regime: large models, where kernels and collectives dominate.
- ``zoo_job``: one engine trains a small zoo model (``harness.models``) built and wrapped exactly as
  the parity matrix does (``harness.adapters``), and reports per-step wall seconds. The host-bound
  regime: tiny kernels, many units, where the engine's Python per step is the cost.

With a profile directory both also run a few extra steps after the timed ones under
``torch.profiler`` (CPU and, on GPUs, CUDA activities; shapes not recorded) and write one Chrome trace
per engine, strategy and rank; the timed steps are never profiled. ``zoo_job`` can also write a
``cProfile`` dump of its timed steps, for the engine's Python hot spots.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.models import GPTBlock
from harness.rank import RankContext

PerfPrecision = Literal["bf16", "fp32"]
ENGINES: tuple[str, ...] = ("builtin", "torch-fsdp", "torch-fsdp2", "ddp")
STRATEGIES: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
#: the fewest ranks a hybrid strategy is measured on: two shard groups of at least two ranks each,
#: else it degenerates into FULL_SHARD (one group) or DDP (groups of one).
HYBRID_MIN_RANKS = 4


# ---------------------------------------------------------------------------------------------------
# The model


#: steps run under the profiler after the timed ones (a trace covers this many steps).
PROFILE_STEPS = 3

@dataclass(frozen=True)
class GPTConfig:
    """Shape of the benchmark's GPT; the defaults are the anchors' model (936.5M parameters)."""

    #: vocabulary size (token embedding rows, LM-head columns).
    vocab: int = 32000
    #: model width.
    d_model: int = 2048
    #: transformer blocks (each one unit).
    layers: int = 16
    #: attention heads; must divide ``d_model``.
    heads: int = 16
    #: tokens per sequence.
    seq: int = 2048
    #: sequences per rank per step.
    batch: int = 8

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "layers", "heads", "seq", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be at least 1")
        if self.d_model % self.heads:
            raise ValueError(f"GPTConfig.heads={self.heads} must divide d_model={self.d_model}")

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq


#: the named sizes of ``--size``. ``3b`` (2.91B parameters) halves the batch so DDP's and NO_SHARD's
#: replicated fp32 parameters, gradients and AdamW state (16 bytes a parameter) plus activations still
#: fit one 80 GiB GPU.
SIZES: dict[str, GPTConfig] = {
    "1b": GPTConfig(),
    "3b": GPTConfig(d_model=3072, layers=24, heads=24, batch=4),
}
#: small enough for two gloo ranks on two CPU cores.
CPU_MODEL = GPTConfig(vocab=512, d_model=64, layers=2, heads=4, seq=64, batch=4)


class GPT(nn.Module):
    """Token embedding, bias-free ``GPTBlock`` blocks, final norm, untied LM head (no learned
    positions: the benchmark measures engines, and the anchors' parameter count has none)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg.d_model, cfg.heads, bias=False) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_params(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)``, without building it."""
    d = cfg.d_model
    block = 12 * d * d + 2 * 2 * d  # qkv, proj, two MLP linears; two LayerNorms (weight and bias)
    return cfg.layers * block + 2 * cfg.vocab * d + 2 * d


def unsupported_reason(engine: str, strategy: str | None, world_size: int) -> str | None:
    """Why ``(engine, strategy)`` is not measured on ``world_size`` ranks; None when it is."""
    if engine != "ddp":
        from harness.adapters import FSDP2Adapter
        from harness.registry import resolve

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


def _hybrid_shard_size(ctx: RankContext) -> int:
    from harness.placement import default_shard_size

    return default_shard_size(ctx.world_size, ctx.local_world_size)


def _fsdp1_wrap(namespace: Any, model: GPT, job: PerfJob, ctx: RankContext) -> nn.Module:
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
    for i, block in enumerate(model.blocks):
        model.blocks[i] = namespace.FullyShardedDataParallel(block, **kwargs)
    return namespace.FullyShardedDataParallel(model, **kwargs)


def _fsdp2_wrap(api: Any, model: GPT, job: PerfJob, ctx: RankContext) -> nn.Module:
    if job.strategy == "hybrid_shard":
        shard = _hybrid_shard_size(ctx)
        mesh = ctx.mesh((ctx.world_size // shard, shard), ("replicate", "shard"))
    else:
        mesh = ctx.mesh((ctx.world_size,), ("shard",))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": job.strategy != "shard_grad_op"}
    if job.precision == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)
    return model


def _wrap(model: GPT, job: PerfJob, ctx: RankContext) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager[Any]]]:
    """The trained module and the context its forward runs in (autocast for DDP in bf16)."""
    if job.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device_type == "cuda" else None)
        if job.precision == "bf16":
            return ddp, lambda: torch.autocast(ctx.device_type, dtype=torch.bfloat16)
        return ddp, contextlib.nullcontext
    import importlib

    from harness.adapters import FSDP2Adapter
    from harness.registry import resolve

    adapter = resolve(job.engine)
    if adapter.fsdp1_module is not None:
        return _fsdp1_wrap(importlib.import_module(adapter.fsdp1_module), model, job, ctx), contextlib.nullcontext
    if isinstance(adapter, FSDP2Adapter):
        return _fsdp2_wrap(adapter.api(), model, job, ctx), contextlib.nullcontext
    raise ValueError(f"perf: engine {adapter.name!r} has neither torch FSDP1's nor FSDP2's API")


def _batches(job: PerfJob, ctx: RankContext) -> list[torch.Tensor]:
    # Made before the timed loop, on the device: data loading is not what is measured.
    from harness.models import mix_seed

    out = []
    for step in range(job.warmup + job.steps):
        g = torch.Generator(device=ctx.device).manual_seed(mix_seed(job.seed, step, ctx.rank))
        out.append(torch.randint(job.model.vocab, (job.model.batch, job.model.seq + 1), device=ctx.device, generator=g))
    return out


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


def perf_job(ctx: RankContext, job: PerfJob) -> dict[str, Any]:
    """Train one engine on this rank: per-step seconds, per-step losses, peak allocated and reserved bytes."""
    reason = unsupported_reason(job.engine, job.strategy, ctx.world_size)
    if reason is not None:
        return {"unsupported": reason}
    _release(ctx)
    # Built on the device under the same seed on every rank and for every engine: same start everywhere,
    # and no multi-GiB copy from the host.
    torch.manual_seed(job.seed)
    with torch.device(ctx.device):
        model = GPT(job.model)
    module, forward_context = _wrap(model, job, ctx)
    optimizer = torch.optim.AdamW(module.parameters(), lr=job.lr)
    batches = _batches(job, ctx)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        with forward_context():
            logits = module(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    _sync(ctx)
    if ctx.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    step_s: list[float] = []
    losses: list[torch.Tensor] = []
    for tokens in batches:
        _sync(ctx)
        t0 = time.perf_counter()
        loss = step(tokens)
        _sync(ctx)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss)
    cuda = ctx.device_type == "cuda"
    result = {
        "step_s": step_s[job.warmup:], "losses": [float(x) for x in losses],
        "peak_bytes": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(ctx.device) if cuda else None,
        "device": torch.cuda.get_device_name(ctx.device) if cuda else "CPU",
    }
    if job.profile_dir is not None:
        path = Path(job.profile_dir) / trace_name(job.engine, job.strategy, ctx.rank)
        with _chrome_trace(ctx, path):
            for i in range(job.profile_steps):
                step(batches[i % len(batches)])
            _sync(ctx)
        result["trace"] = str(path)
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


def zoo_job(ctx: RankContext, job: ZooJob) -> dict[str, Any]:
    """Per-step wall seconds of one engine on one zoo model (no gradient reads, no trace hooks: the
    engine's own cost), and its final loss."""
    from harness.adapters import prepare_inputs
    from harness.registry import resolve
    from harness.case import CaseConfig
    from harness.dtypes import dtype_of
    from harness.models import build_model

    reason = unsupported_reason(job.engine, job.strategy, ctx.world_size)
    if reason is not None:
        return {"unsupported": reason}
    case = CaseConfig(engine=job.engine, model=job.model, sharding_strategy=job.strategy,  # type: ignore[arg-type]
                      precision=job.precision, world_size=ctx.world_size, seed=job.seed)  # type: ignore[arg-type]
    adapter = resolve(case.engine)
    full = dtype_of(case.precision_spec.full)
    model = build_model(case.model, seed=case.seed, rank=ctx.rank, world_size=ctx.world_size).to(full)
    reason = adapter.unsupported_reason(case, model, ctx)
    if reason is not None:
        return {"unsupported": reason}
    _sync(ctx)
    t_build = time.perf_counter()
    trainee = adapter.build(case, model, ctx)
    _sync(ctx)
    build_s = time.perf_counter() - t_build
    zoo = trainee.zoo
    optimizer = torch.optim.SGD(trainee.trainable_parameters(), lr=case.lr, momentum=case.momentum)
    batches = [prepare_inputs(zoo.get_input(seed=case.seed, step=s, rank=ctx.rank), ctx.device, full)
               for s in range(job.warmup + job.steps)]

    def step(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = zoo.get_loss(inputs, trainee.module(*inputs))
        zoo.run_backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step_s: list[float] = []
    # CPU seconds of this rank's process per step (its threads together): the host cost itself, less
    # blurred than wall time by ranks waiting on each other when the host's cores are shared.
    cpu_s: list[float] = []
    losses: list[float] = []
    profiler = cProfile.Profile() if job.cprofile else None
    for i, inputs in enumerate(batches):
        timed = i >= job.warmup
        _sync(ctx)
        if profiler is not None and timed:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(inputs)
        _sync(ctx)
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)
        if profiler is not None and timed:
            profiler.disable()
        losses.append(float(loss))
    # Wrapping and the first step (lazy init) are paid once per parity case: part of the host-bound cost.
    result: dict[str, Any] = {"step_s": step_s[job.warmup:], "cpu_s": cpu_s[job.warmup:], "losses": losses,
                              "build_s": build_s, "first_step_s": step_s[0] if step_s else None, "peak_bytes": None,
                              "reserved_bytes": None, "units": sum(1 for _ in zoo.wrap_units()) + 1,
                              "device": torch.cuda.get_device_name(ctx.device) if ctx.device_type == "cuda" else "CPU"}
    if job.profile_dir is not None:
        directory = Path(job.profile_dir)
        if profiler is not None:
            directory.mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(directory / trace_name(job.engine, job.strategy, ctx.rank, job.model, "prof"))
        with _chrome_trace(ctx, directory / trace_name(job.engine, job.strategy, ctx.rank, job.model)):
            for i in range(job.profile_steps):
                step(batches[i % len(batches)])
            _sync(ctx)
    return result
