"""``python -m harness perf``: training-step benchmark of our engine against torch FSDP1, same run.

Two regimes, each engine after the other on one persistent rank pool (2 GPUs with NCCL, or 2 gloo
ranks on CPU with a tiny model); ``harness.perf.benchmark`` is the rank side, ``harness.perf.perf_run`` the rows:

- the GPT (default): a GPT-like model with one block per unit, AdamW, bf16 compute with fp32 gradient
  reduction. ``--size 1b`` (default on GPUs) is the anchors' model (vocab 32000, d 2048, 16 layers,
  16 heads, 936.5M parameters, batch 8 x 2048 tokens per GPU), ``--size 3b`` 2.91B parameters
  (d 3072, 24 layers, batch 4 x 2048); on CPU a tiny GPT. Engines: ``builtin``
  (``engine.FullyShardedDataParallel``) and ``torch-fsdp`` (torch FSDP1), both with
  ``use_orig_params=True``, ``BACKWARD_PRE``, ``limit_all_gathers=True``; ``torch-fsdp2``
  (``fully_shard``; SHARD_GRAD_OP is ``reshard_after_forward=False``); ``ddp`` under bf16 autocast
  (once, no strategy). HYBRID_SHARD needs 4+ ranks and is reported as not applicable below that.
- ``--small``: the host-bound regime, small zoo models with many units (``--zoo-models``), built and
  wrapped exactly as the parity matrix builds them, per-step wall time of each engine.
- ``--host-cost``: the engines' host time per step, with no rank pool and no GPU: this process is rank 0
  of torch's fake process group (collectives are no-ops, everything else runs; ``harness.perf.host_cost``),
  the GPT with tiny tensors and many units (default 32 layers, width 8, 4 tokens: 33 units), each step
  timed in process time with one intra-op thread and the garbage collector off; ``model-alone`` (the model
  and AdamW, no wrapper) is the baseline row. Losses are not compared (no-op collectives).

Columns: the median over the timed steps of the slowest rank's step time and its p10..p90 spread,
peak allocated and reserved memory (the largest rank's), tokens/s of all ranks, TFLOP/s per GPU by the
6N rule, the final loss, the ratio to torch FSDP1 with the same strategy measured in this run and the
ratio to the faster torch engine (of torch FSDP1 and FSDP2, the one with the smaller step time at that
strategy in this run; one that failed or ran out of memory is not a candidate). ``--repeats N`` runs N
interleaved repetitions on the same pool, each every engine and strategy once with the engine order
rotated: the step time is then the median of the repetitions' (min..max in place of p10..p90), peak
memory the largest, and each ratio the median of the per-repetition (paired) ratios, printed with their
range (``harness.perf.perf_rows``). Under the table, each row's step split into phases (forward to the
loss, backward, optimizer step with ``zero_grad``; ``harness.perf.phases``): the median over the timed steps
of each step's slowest rank's, GPU time between CUDA events on GPUs and host time on CPU, their sum beside
the step time, and each phase over the faster torch engine's. ``--json`` keeps the summary rows and every
repetition's, each with its phases (``phase_ms``, and per step ``steps_phase_ms``).
``--profile DIR`` writes a Chrome trace of a few extra steps per engine, strategy and rank, and on CPU ranks the
peak of live tensors of one more step, with its largest allocations (``harness.perf.memory_peak``).

Exit status: 0; 1 when a run failed or a final loss differs from torch FSDP1's by more than
``--loss-rtol``; 2 when the ranks could not start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from harness.cli.options import add_placement, positive_float, positive_int
from harness.perf.benchmark import CPU_MODEL, ENGINES, MODEL_ALONE, SIZES, STRATEGIES, GPTConfig, count_params
from harness.perf.host_cost import HOST_COST_MODEL
from harness.perf.perf_rows import BASELINE, TORCH_ENGINES, PerfRow, phase_table, ratio_lines, summarize, table
from harness.perf.phases import STEP_PHASES
from harness.perf.perf_run import ZOO_MODELS, PerfConfig, run_repetitions


def config_from_args(args: argparse.Namespace) -> PerfConfig:
    """The run the options ask for; ``ValueError`` names a bad option."""
    from harness.ranks.placement import n_gpus, place

    if args.host_cost:
        # No ranks to place: one process on the CPU, whatever GPUs the host has.
        for flag, value, why in (("--backend", args.backend != "auto", "no ranks to connect"),
                                 ("--device", args.device == "cuda", "it times the host"),
                                 ("--size", args.size is not None, "GPU-sized models; set --layers, --d-model, ... instead")):
            if value:
                raise ValueError(f"--host-cost runs one process on the CPU over a fake process group: drop {flag} ({why})")
        backend, devices, base = "gloo", None, HOST_COST_MODEL
    else:
        lane = place(args.world_size, n_gpus(), args.backend, args.device)  # PlacementError is a ValueError
        backend, devices = lane.backend, lane.devices
        if args.size is not None:
            base = SIZES[args.size]
        else:
            base = SIZES["1b"] if lane.device == "cuda" else CPU_MODEL
    sizes = {name: getattr(args, name) for name in ("vocab", "d_model", "layers", "heads", "seq", "batch")}
    model = GPTConfig(**{**asdict(base), **{k: v for k, v in sizes.items() if v is not None}})
    default_engines = [*TORCH_ENGINES, MODEL_ALONE] if args.host_cost else [BASELINE]
    engines = args.engines if args.engines is not None else ["builtin", *default_engines]
    precision = args.precision or ("fp32" if args.small else "bf16")
    return PerfConfig(
        model=model, engines=engines, strategies=args.strategies, precision=precision,
        warmup=args.warmup, steps=args.steps, seed=args.seed, lr=args.lr, world_size=args.world_size,
        backend=backend, devices=devices, timeout_s=args.timeout,  # type: ignore[arg-type]
        loss_rtol=None if args.host_cost else args.loss_rtol,
        profile_dir=str(args.profile) if args.profile is not None else None,
        zoo_models=list(args.zoo_models) if args.small else [], cprofile=args.cprofile, repeats=args.repeats,
        host_cost=args.host_cost,
    )


def _header(config: PerfConfig, device: str) -> str:
    m = config.model
    where = f"{config.world_size} ranks, {config.backend}, {device}, torch {torch.__version__}"
    if config.host_cost:
        where = (f"one process, rank 0 of a fake process group of {config.world_size} ranks, {device}, "
                 f"torch {torch.__version__}\nhost cost: step ms is a step's process time over no-op collectives (one "
                 "intra-op thread, gc off in the timed steps): the engines' host work, not a training speed; losses "
                 f"not compared; {MODEL_ALONE}: the model and AdamW alone, no wrapper, fp32 (the baseline)")
    shared = config.devices is not None and len(set(config.devices)) < len(config.devices)
    if shared:
        where += ("\nranks share GPUs through gloo: step times include the host staging of every collective "
                  "and no NCCL overlap; compare engines within this run only")
    timing = f"median of {config.steps} steps after {config.warmup} warm-up steps"
    if config.repeats > 1:
        timing += (f"; {config.repeats} interleaved repetitions (engine order rotated each): median over them, "
                   "min..max across them, ratios paired per repetition")
    if config.zoo_models:
        return (f"{where}\nhost-bound regime: zoo models {', '.join(config.zoo_models)} built and wrapped as the "
                f"parity matrix does; {config.precision}; SGD; per-step wall time; {timing}")
    prec = "bf16 compute, fp32 reduce" if config.precision == "bf16" else "fp32"
    params = f"{count_params(m) / 1e6:.1f}M" if count_params(m) >= 10**5 else f"{count_params(m):,}"
    return (f"{where}\n"
            f"GPT vocab {m.vocab}, d {m.d_model}, {m.layers} layers, {m.heads} heads: {params} params; "
            f"batch {m.batch} x {m.seq} tokens per rank; {prec}; AdamW; one block per unit; {timing}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--engines", type=csv, default=None,
                   help=f"comma list of {','.join(ENGINES)} (default builtin,{BASELINE}; with --host-cost "
                        f"builtin,{','.join(TORCH_ENGINES)},{MODEL_ALONE}; {MODEL_ALONE} only there)")
    p.add_argument("--strategies", type=csv, default=["full_shard"],
                   help=f"comma list of {','.join(STRATEGIES)} for the FSDP engines (default full_shard)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="GPT size: 1b (the anchors' 936.5M model, default on GPUs) or 3b (2.91B); default on CPU: tiny")
    p.add_argument("--small", action="store_true",
                   help="host-bound regime: time small zoo models with many units instead of the GPT")
    p.add_argument("--host-cost", action="store_true",
                   help="the engines' host time per step: one process over torch's fake process group (no-op "
                        "collectives), no ranks and no GPU, each step in process time with gc off; the GPT with "
                        f"tiny tensors and many units ({HOST_COST_MODEL.layers} layers, width {HOST_COST_MODEL.d_model}, "
                        f"{HOST_COST_MODEL.seq} tokens by default) and the model alone as the baseline row")
    p.add_argument("--zoo-models", type=csv, default=list(ZOO_MODELS),
                   help=f"zoo models of --small (default {','.join(ZOO_MODELS)})")
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="interleaved repetitions of every engine and strategy on the same ranks, the engine order "
                        "rotated each; reports the median and min..max over them and paired ratios (default 1; 3 or 5 on GPUs)")
    for name, help_text in (("vocab", "vocabulary"), ("d-model", "model width"), ("layers", "blocks"),
                            ("heads", "attention heads"), ("seq", "tokens per sequence"), ("batch", "sequences per rank")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{help_text} (default: the --size model on GPUs, {getattr(CPU_MODEL, name.replace('-', '_'))} on CPU)")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"),
                   help="default bf16 for the GPT, fp32 (the matrix's default) for --small")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2)
    add_placement(p)
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per engine run before it is a timeout")
    p.add_argument("--loss-rtol", type=float, default=1e-3, help="allowed relative difference of final losses")
    p.add_argument("--profile", type=Path, default=None,
                   help="write torch profiler Chrome traces (a few steps after the timed ones) per engine, strategy and rank here; on CPU ranks also the peak of live tensors of one more step")
    p.add_argument("--cprofile", action="store_true", help="with --small and --profile: also a cProfile dump of the timed steps")
    p.add_argument("--json", type=Path, default=None, help="also write the configuration and rows here")


def _print_trace_summaries(directory: Path) -> None:
    """Each trace's GPU time, streams, overlap and top kernels, and its steps as the timer saw them
    (``harness.perf.profile_summary``); a trace of CPU ranks: the host's step and its first collective, and the
    rank's peak of live tensors (``harness.perf.memory_peak``)."""
    from harness.perf.benchmark import MEMORY_SUFFIX, PROFILE_STEPS
    from harness.perf.memory_peak import memory_lines
    from harness.perf.profile_summary import (
        gpu_events, host_collectives, host_syncs, load_trace, step_breakdown, step_marks, summarize, summary_lines,
    )

    for path in sorted(directory.glob("*.json")):
        if path.name.endswith(MEMORY_SUFFIX):
            name = path.name.removesuffix(MEMORY_SUFFIX)
            print("\n".join(memory_lines(name, json.loads(path.read_text(encoding="utf-8")))))
            continue
        trace = load_trace(path)
        events, marks = gpu_events(trace), step_marks(trace)
        if events or marks:
            steps = step_breakdown(events, marks, host_syncs(trace), collectives=host_collectives(trace))
            print("\n".join(summary_lines(path.stem, summarize(events, PROFILE_STEPS), steps)))


def phase_clock(device: str, host_cost: bool = False) -> str:
    """What a phase's time is on ``device`` (the ranks' answer: a GPU's name, or ``CPU``)."""
    if host_cost:
        return "process time (process_time) between the phase boundaries"
    if device == "CPU":
        return "host time (perf_counter) between the phase boundaries"
    return "GPU time between CUDA events on each rank's current stream"


def json_data(config: PerfConfig, device: str, wall_s: float, rows: list[PerfRow],
              repetitions: list[list[PerfRow]]) -> dict[str, object]:
    """What ``--json`` writes: the configuration, the summary ``rows`` (one per engine and strategy) and,
    under ``repetitions``, every repetition's rows in the order they ran."""
    return {"config": asdict(config), "params": None if config.zoo_models else count_params(config.model),
            "torch": torch.__version__, "device": device, "wall_s": wall_s, "repeats": config.repeats,
            "phases": list(STEP_PHASES), "phase_clock": phase_clock(device, config.host_cost),
            "rows": [asdict(r) for r in rows],
            "repetitions": [{"repetition": i + 1, "order": [r.label for r in rep], "rows": [asdict(r) for r in rep]}
                            for i, rep in enumerate(repetitions)]}


def main(args: argparse.Namespace) -> int:
    from harness.ranks.pool import PoolStartError

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"harness perf: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        repetitions, device = run_repetitions(config)
    except (PoolStartError, ValueError) as exc:  # ValueError: fewer GPUs than --world-size
        print(f"harness perf: {exc}", file=sys.stderr)
        return 2
    rows = summarize(repetitions, config.loss_rtol)
    print(_header(config, device))
    print(table(rows))
    for line in ratio_lines(rows):
        print(line)
    phases = phase_table(rows, phase_clock(device, config.host_cost))
    if phases:
        print(phases)
    wall = time.monotonic() - start
    failed = [r.label for r in rows if r.status not in ("ok", "unsupported")]
    differs = [r.label for r in rows if r.loss_matches is False]
    runs = f"{len(rows)} runs" + (f" x {config.repeats} repetitions" if config.repeats > 1 else "")
    print(f"{runs} in {wall:.1f} s" + (f"; failed: {failed}" if failed else "")
          + (f"; final loss differs from {BASELINE}: {differs}" if differs else "")
          + (f"; traces in {config.profile_dir}" if config.profile_dir else ""))
    if config.profile_dir:
        _print_trace_summaries(Path(config.profile_dir))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_data(config, device, wall, rows, repetitions), indent=2) + "\n",
                             encoding="utf-8")
    return 1 if failed or differs else 0
