"""``python -m harness perf``: training-step benchmark of our engine against torch FSDP1, same run.

A GPT-like model (bias-free linears, pre-norm blocks, untied LM head; with the defaults on GPUs it is
the GPT-like anchor model the team measures torch FSDP1, FSDP2 and DDP on: vocab 32000, d 2048, 16 layers, 16 heads, 936.5M parameters,
batch 8 x 2048 tokens per GPU) is trained by every selected engine in turn on one persistent rank
pool (``harness.pool.RankPool``: 2 GPUs with NCCL, or 2 gloo ranks on CPU with a tiny model), with
one transformer block per unit, AdamW, and bf16 compute with fp32 gradient reduction:

- ``builtin``: ``engine.FullyShardedDataParallel``, and ``torch-fsdp``: torch FSDP1, both with
  ``use_orig_params=True``, ``BACKWARD_PRE``, ``limit_all_gathers=True`` and
  ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``;
- ``torch-fsdp2``: ``fully_shard`` (FULL_SHARD: ``reshard_after_forward=True``, SHARD_GRAD_OP: False)
  with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- ``ddp``: DistributedDataParallel over fp32 parameters under bf16 autocast (one run, no strategy).

Each runs warm-up steps, then timed steps (a step: forward, loss, backward, optimizer step, with the
device synchronized around it). The table gives the median over the timed steps of the slowest
rank's step time, the peak allocated memory of the training steps (the largest rank's), TFLOP/s per
GPU by the 6N rule (6 x parameters x tokens per GPU per step), the final loss (mean over ranks),
and the ratio of every step time to torch FSDP1's with the same strategy, measured in this run.

Exit status: 0; 1 when a run failed or a final loss differs from torch FSDP1's by more than
``--loss-rtol``; 2 when the ranks could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.rank import RankContext

PerfEngine = Literal["builtin", "torch-fsdp", "torch-fsdp2", "ddp"]
PerfStrategy = Literal["full_shard", "shard_grad_op", "no_shard"]
PerfPrecision = Literal["bf16", "fp32"]
ENGINES: tuple[str, ...] = ("builtin", "torch-fsdp", "torch-fsdp2", "ddp")
STRATEGIES: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard")
#: the engine every ratio is taken against.
BASELINE = "torch-fsdp"
GIB = 1024**3


# ---------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the benchmark's GPT; the defaults are the anchors' model."""

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


#: small enough for two gloo ranks on two CPU cores.
CPU_MODEL = GPTConfig(vocab=512, d_model=64, layers=2, heads=4, seq=64, batch=4)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP, bias-free linears."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token embedding, blocks, final norm, untied LM head (no learned positions: the benchmark
    measures engines, and the anchors' parameter count has none)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
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
    block = 12 * d * d + 2 * 2 * d  # qkv, proj, fc1, fc2; two LayerNorms (weight and bias)
    return cfg.layers * block + 2 * cfg.vocab * d + 2 * d


def tflops_per_gpu(params: int, tokens_per_rank: int, step_s: float) -> float:
    """Model TFLOP/s per GPU by the 6N rule (forward 2N, backward 4N per token)."""
    return 6 * params * tokens_per_rank / step_s / 1e12


# ---------------------------------------------------------------------------------------------------
# Rank side


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


def _unsupported(job: PerfJob) -> str | None:
    if job.engine == "torch-fsdp2" and job.strategy == "no_shard":
        return "torch-fsdp2: fully_shard always shards; NO_SHARD has no equivalent (DDP is the replicated run)"
    return None


def _fsdp1_wrap(namespace: Any, model: GPT, job: PerfJob, ctx: RankContext) -> nn.Module:
    """Every block its own unit, then the root, with the options FSDP1 is benchmarked with."""
    kwargs: dict[str, Any] = {
        "sharding_strategy": getattr(namespace.ShardingStrategy, str(job.strategy).upper()),
        "backward_prefetch": namespace.BackwardPrefetch.BACKWARD_PRE,
        "limit_all_gathers": True,
        "use_orig_params": True,
        "device_id": ctx.device,
    }
    if job.precision == "bf16":
        kwargs["mixed_precision"] = namespace.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = namespace.FullyShardedDataParallel(block, **kwargs)
    return namespace.FullyShardedDataParallel(model, **kwargs)


def _fsdp2_wrap(model: GPT, job: PerfJob, ctx: RankContext) -> nn.Module:
    from harness.adapters import FSDP2Adapter

    api = FSDP2Adapter.api()
    kwargs: dict[str, Any] = {
        "mesh": ctx.mesh((ctx.world_size,), ("shard",)),
        "reshard_after_forward": job.strategy == "full_shard",
    }
    if job.precision == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)
    return model


def _wrap(model: GPT, job: PerfJob, ctx: RankContext) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager[Any]]]:
    """The trained module and the context its forward runs in (autocast for DDP in bf16)."""
    if job.engine == "builtin":
        import engine

        return _fsdp1_wrap(engine, model, job, ctx), contextlib.nullcontext
    if job.engine == "torch-fsdp":
        import torch.distributed.fsdp as torch_fsdp

        return _fsdp1_wrap(torch_fsdp, model, job, ctx), contextlib.nullcontext
    if job.engine == "torch-fsdp2":
        return _fsdp2_wrap(model, job, ctx), contextlib.nullcontext
    if job.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device_type == "cuda" else None)
        if job.precision == "bf16":
            return ddp, lambda: torch.autocast(ctx.device_type, dtype=torch.bfloat16)
        return ddp, contextlib.nullcontext
    raise ValueError(f"perf: engine={job.engine!r} is not one of {list(ENGINES)}")


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


def perf_job(ctx: RankContext, job: PerfJob) -> dict[str, Any]:
    """Train one engine on this rank: per-step seconds, per-step losses, peak allocated bytes."""
    reason = _unsupported(job)
    if reason is not None:
        return {"unsupported": reason}
    gc.collect()
    if ctx.device_type == "cuda":
        torch.cuda.empty_cache()
    # Built on the device under the same seed on every rank and for every engine: same start everywhere,
    # and no multi-GiB copy from the host.
    torch.manual_seed(job.seed)
    with torch.device(ctx.device):
        model = GPT(job.model)
    module, forward_context = _wrap(model, job, ctx)
    optimizer = torch.optim.AdamW(module.parameters(), lr=job.lr)
    batches = _batches(job, ctx)
    _sync(ctx)
    if ctx.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    step_s: list[float] = []
    losses: list[torch.Tensor] = []
    for tokens in batches:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        _sync(ctx)
        t0 = time.perf_counter()
        with forward_context():
            logits = module(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(ctx)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device_type == "cuda" else None
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device_type == "cuda" else "CPU"
    result = {"step_s": step_s[job.warmup:], "losses": [float(x) for x in losses], "peak_bytes": peak, "device": device_name}
    del module, model, optimizer, batches, losses, logits, loss
    gc.collect()
    if ctx.device_type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------------
# Parent side: plain data


@dataclass
class PerfRow:
    """One engine's line of the table."""

    engine: str
    strategy: str | None
    #: ``ok``, ``unsupported`` or the pool outcome (``error``, ``timeout``, ``crash``).
    status: str
    reason: str = ""
    #: median over the timed steps of the slowest rank's step time.
    step_ms: float | None = None
    #: largest rank's peak allocated GiB during training; None on CPU.
    peak_gib: float | None = None
    tflops: float | None = None
    #: last step's loss, mean over ranks.
    final_loss: float | None = None
    #: this step time over torch FSDP1's with the same strategy, same run.
    ratio: float | None = None
    #: whether the final loss is within ``--loss-rtol`` of torch FSDP1's; None without a baseline.
    loss_matches: bool | None = None
    #: every timed step (slowest rank), for the JSON.
    steps_ms: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.engine if self.strategy is None else f"{self.engine} {self.strategy}"


def plan_runs(engines: Sequence[str], strategies: Sequence[str]) -> list[tuple[str, str | None]]:
    """``(engine, strategy)`` pairs in the order they run: per strategy, the engines; DDP once, last."""
    runs: list[tuple[str, str | None]] = [(e, s) for s in strategies for e in engines if e != "ddp"]
    if "ddp" in engines:
        runs.append(("ddp", None))
    return runs


def row_from_values(engine: str, strategy: str | None, values: Sequence[dict[str, Any]], params: int, tokens_per_rank: int) -> PerfRow:
    """A row from every rank's ``perf_job`` answer."""
    if "unsupported" in values[0]:
        return PerfRow(engine, strategy, "unsupported", values[0]["unsupported"])
    per_step = [max(steps) for steps in zip(*(v["step_s"] for v in values))]
    step_s = statistics.median(per_step)
    peaks = [v["peak_bytes"] for v in values if v["peak_bytes"] is not None]
    final = statistics.fmean(v["losses"][-1] for v in values)
    return PerfRow(
        engine, strategy, "ok", step_ms=1000 * step_s, peak_gib=max(peaks) / GIB if peaks else None,
        tflops=tflops_per_gpu(params, tokens_per_rank, step_s), final_loss=final,
        steps_ms=[1000 * s for s in per_step],
    )


def add_ratios(rows: Sequence[PerfRow], loss_rtol: float) -> None:
    """Fill every row's ratio and loss check against torch FSDP1 with the same strategy (DDP against
    FULL_SHARD, the anchors' FSDP1 configuration)."""
    baselines = {r.strategy: r for r in rows if r.engine == BASELINE and r.status == "ok"}
    for row in rows:
        base = baselines.get(row.strategy if row.strategy is not None else "full_shard")
        if base is None or row.status != "ok" or row.step_ms is None or base.step_ms is None:
            continue
        row.ratio = row.step_ms / base.step_ms
        assert row.final_loss is not None and base.final_loss is not None
        row.loss_matches = math.isclose(row.final_loss, base.final_loss, rel_tol=loss_rtol, abs_tol=0.0)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[PerfRow]) -> str:
    from tabulate import tabulate

    body = []
    for r in rows:
        if r.status != "ok":
            body.append((r.label, r.status, "-", "-", "-", "-", "-", r.reason[:80]))
            continue
        match = "" if r.loss_matches is None else ("matches" if r.loss_matches else "DIFFERS")
        body.append((r.label, "ok", _fmt(r.step_ms, ".1f"), _fmt(r.peak_gib, ".1f"), _fmt(r.tflops, ".3g"),
                     _fmt(r.final_loss, ".4f"), _fmt(r.ratio, ".3f"), match))
    headers = ("engine", "status", "step ms", "peak alloc GiB", "TFLOP/s/GPU", "final loss", f"x {BASELINE}", "loss")
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def ratio_lines(rows: Sequence[PerfRow]) -> list[str]:
    """The headline: our engine's step time over torch FSDP1's, per strategy."""
    lines = []
    for r in rows:
        if r.engine == "builtin" and r.ratio is not None:
            base = next(b for b in rows if b.engine == BASELINE and b.strategy == r.strategy)
            lines.append(f"ratio builtin / {BASELINE} step time ({r.strategy}): {r.ratio:.3f} "
                         f"({r.step_ms:.1f} ms vs {base.step_ms:.1f} ms, same run)")
        elif r.engine == "builtin":
            lines.append(f"ratio builtin / {BASELINE} ({r.strategy}): not measured ({BASELINE} {r.strategy} did not run ok)")
    return lines


# ---------------------------------------------------------------------------------------------------
# Configuration and the run


@dataclass
class PerfConfig:
    """What ``python -m harness perf`` runs."""

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
    #: ``nccl`` (one GPU per rank) or ``gloo`` (CPU).
    backend: Literal["gloo", "nccl"] = "gloo"
    #: seconds one engine's run may take before it is a timeout.
    timeout_s: float = 300.0
    #: a final loss further than this (relative) from torch FSDP1's fails the benchmark.
    loss_rtol: float = 1e-3

    def __post_init__(self) -> None:
        for name, allowed in (("engines", ENGINES), ("strategies", STRATEGIES)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad or not getattr(self, name):
                raise ValueError(f"PerfConfig.{name}={getattr(self, name)}: choose one or more of {list(allowed)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"PerfConfig: steps={self.steps} must be >= 1 and warmup={self.warmup} >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PerfConfig":
        from harness.placement import default_backend

        backend = args.backend if args.backend != "auto" else default_backend(args.world_size)
        base = GPTConfig() if backend == "nccl" else CPU_MODEL
        sizes = {name: getattr(args, name) for name in ("vocab", "d_model", "layers", "heads", "seq", "batch")}
        model = GPTConfig(**{**asdict(base), **{k: v for k, v in sizes.items() if v is not None}})
        return cls(
            model=model, engines=args.engines, strategies=args.strategies, precision=args.precision,
            warmup=args.warmup, steps=args.steps, seed=args.seed, lr=args.lr, world_size=args.world_size,
            backend=backend, timeout_s=args.timeout, loss_rtol=args.loss_rtol,
        )


def run(config: PerfConfig) -> tuple[list[PerfRow], str]:
    """Every planned run on one pool, in order, and the device the ranks ran on (asked of the ranks, so
    this process never touches the GPUs); raises ``PoolStartError`` when the ranks cannot start."""
    from harness.placement import assign_devices
    from harness.pool import PoolConfig, RankPool

    devices = assign_devices(config.world_size, torch.cuda.device_count()) if config.backend == "nccl" else None
    pool_config = PoolConfig(world_size=config.world_size, backend=config.backend, devices=devices,
                             case_timeout_s=config.timeout_s)
    params = count_params(config.model)
    rows: list[PerfRow] = []
    device = "?"
    with RankPool(pool_config) as pool:
        for engine_name, strategy in plan_runs(config.engines, config.strategies):
            job = PerfJob(engine_name, strategy, config.model, config.precision, config.warmup, config.steps,
                          config.seed, config.lr)
            outcome = pool.run(perf_job, job)
            if outcome.status == "ok":
                device = outcome.values[0].get("device", device)
                rows.append(row_from_values(engine_name, strategy, outcome.values, params, config.model.tokens_per_rank))
            else:
                rows.append(PerfRow(engine_name, strategy, outcome.status, outcome.reason))
            print(f"  {rows[-1].label}: {rows[-1].status}"
                  + (f", {rows[-1].step_ms:.1f} ms/step" if rows[-1].step_ms is not None else ""),
                  file=sys.stderr, flush=True)
    add_ratios(rows, config.loss_rtol)
    return rows, device


def _header(config: PerfConfig, device: str) -> str:
    m = config.model
    where = f"{config.world_size} ranks, {config.backend}, {device}"
    prec = "bf16 compute, fp32 reduce" if config.precision == "bf16" else "fp32"
    return (f"{where}, torch {torch.__version__}\n"
            f"GPT vocab {m.vocab}, d {m.d_model}, {m.layers} layers, {m.heads} heads: {count_params(m) / 1e6:.1f}M params; "
            f"batch {m.batch} x {m.seq} tokens per rank; {prec}; AdamW; one block per unit; "
            f"median of {config.steps} steps after {config.warmup} warm-up steps")


def add_arguments(p: argparse.ArgumentParser) -> None:
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--engines", type=csv, default=["builtin", BASELINE],
                   help=f"comma list of {','.join(ENGINES)} (default builtin,{BASELINE})")
    p.add_argument("--strategies", type=csv, default=["full_shard"],
                   help=f"comma list of {','.join(STRATEGIES)} for the FSDP engines (default full_shard)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    for name, help_text in (("vocab", "vocabulary"), ("d-model", "model width"), ("layers", "blocks"),
                            ("heads", "attention heads"), ("seq", "tokens per sequence"), ("batch", "sequences per rank")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{help_text} (default: the anchors' model on GPUs, {getattr(CPU_MODEL, name.replace('-', '_'))} on CPU)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: NCCL with one GPU per rank when there are enough GPUs, else gloo on CPU")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per engine run before it is a timeout")
    p.add_argument("--loss-rtol", type=float, default=1e-3, help="allowed relative difference of final losses")
    p.add_argument("--json", type=Path, default=None, help="also write the configuration and rows here")


def main(args: argparse.Namespace) -> int:
    from harness.pool import PoolStartError

    try:
        config = PerfConfig.from_args(args)
    except ValueError as exc:
        print(f"harness perf: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        rows, device = run(config)
    except (PoolStartError, ValueError) as exc:  # ValueError: fewer GPUs than --world-size
        print(f"harness perf: {exc}", file=sys.stderr)
        return 2
    print(_header(config, device))
    print(table(rows))
    for line in ratio_lines(rows):
        print(line)
    wall = time.monotonic() - start
    failed = [r.label for r in rows if r.status not in ("ok", "unsupported")]
    differs = [r.label for r in rows if r.loss_matches is False]
    print(f"{len(rows)} runs in {wall:.1f} s" + (f"; failed: {failed}" if failed else "")
          + (f"; final loss differs from {BASELINE}: {differs}" if differs else ""))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"config": asdict(config), "params": count_params(config.model), "torch": torch.__version__, "device": device,
                "wall_s": wall, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 1 if failed or differs else 0
