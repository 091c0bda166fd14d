"""The neutral description of one parity case.

A case is plain, picklable, hashable data: the matrix generator produces them, the pool ships
them to every rank, the adapters translate them into each engine's native options, and the
collector records them. Nothing in here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

ReferenceName = Literal["ddp", "local"]
#: What a strategy shards: ``full_shard`` parameters, gradients and optimizer state (ZeRO-3);
#: ``shard_grad_op`` gradients and optimizer state, parameters gathered in forward and kept through
#: backward; ``no_shard`` nothing; the hybrid ones shard within a group and replicate across groups;
#: ``zero1`` optimizer state only and ``zero2`` gradients and optimizer state, parameters never sharded
#: (unlike ``shard_grad_op``, which still gathers them in forward). Each engine maps the ones it has.
ShardingName = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "zero1", "zero2"]
PrecisionName = Literal[
    "fp32", "fp64", "bf16", "fp16", "reduce_only", "param_buffer", "fp16_bf16buf_fp32reduce"
]
PrefetchName = Literal["none", "pre", "post"]
InitModeName = Literal["before", "after", "never"]
#: ``delay``: the harness delays the CUDA compute stream where a missing stream wait would show
#: (``harness.compare.stress``); ``none``: no delays.
StressName = Literal["none", "delay"]

#: Each strategy's member of FSDP1's ``ShardingStrategy`` (and ``HandleShardingStrategy``), by name.
FSDP1_STRATEGIES: dict[str, str] = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
    "hybrid_shard": "HYBRID_SHARD",
    "hybrid_shard_zero2": "_HYBRID_SHARD_ZERO2",
}
#: Each backward prefetch's member of FSDP1's ``BackwardPrefetch`` by name; None: no prefetch.
FSDP1_PREFETCHES: dict[str, str | None] = {"none": None, "pre": "BACKWARD_PRE", "post": "BACKWARD_POST"}

#: The strategies that shard within a group of ranks and replicate across groups.
HYBRID_STRATEGIES: tuple[str, ...] = ("hybrid_shard", "hybrid_shard_zero2")
#: The strategies that never shard parameters (DeepSpeed ZeRO-1 and ZeRO-2): no FSDP engine has them, so
#: they are off the default strategy axis (older selections and ids keep their cases) and join it only
#: for engines that declare them (``EngineAdapter.strategies``, ``harness.selection.matrix.resolve_axes``).
ZERO_STRATEGIES: tuple[str, ...] = ("zero1", "zero2")
#: The strategies of torch FSDP1's ``ShardingStrategy``: the default strategy axis.
FSDP_STRATEGIES: tuple[str, ...] = tuple(s for s in get_args(ShardingName) if s not in ZERO_STRATEGIES)
#: The strategies one group of ranks runs (the hybrid ones need groups of their own: 4 ranks or more).
FLAT_STRATEGIES: list[str] = [s for s in FSDP_STRATEGIES if s not in HYBRID_STRATEGIES]


def is_hybrid(strategy: str) -> bool:
    """Whether a ``ShardingName`` shards within groups and replicates across them."""
    return strategy in HYBRID_STRATEGIES


_D = TypeVar("_D")


def reduce_dtype_default(full: _D, param: _D | None, reduce: _D | None) -> _D:
    """The dtype gradients are reduced in, FSDP1's rule: ``reduce`` if set, else ``param`` if set, else
    ``full``. Works on dtype names and on ``torch.dtype`` alike."""
    return reduce if reduce is not None else param if param is not None else full


#: The engines a run tests when none is named (``harness.engines.registry`` registers them; kept here, torch-free,
#: so readers of results can order them without importing any engine).
DEFAULT_ENGINES: tuple[str, ...] = ("builtin", "torch-fsdp", "torch-fsdp2")


def engine_name(spec: str) -> str:
    """The name part of an engine spec: ``mine`` of ``mine=fsdp1:pkg``; a bare name is its own name."""
    return spec.partition("=")[0].strip()
#: ``adamw_groups``: AdamW with a decay and a no-decay group at two learning rates and some parameters
#: frozen; ``two_optimizers``: Adam and AdamW over disjoint parameters (``harness.engines.optim``).
OptimizerName = Literal["sgd", "adamw", "adamw_groups", "two_optimizers"]
#: ``norm``: ``clip_grad_norm_`` to a max norm small enough to clip every step; the returned total norm is
#: compared every step (``harness.compare.training``).
ClipGradName = Literal["none", "norm"]
#: ``no_sync``: ``ACCUM_MICRO_BATCHES`` micro-batches per step, all but the last skipping gradient
#: synchronization; ``sync``: the same micro-batches, each synchronized.
GradAccumName = Literal["none", "no_sync", "sync"]
#: Micro-batches per optimizer step when ``grad_accum`` is not ``none``.
ACCUM_MICRO_BATCHES = 2
#: ``clip_grad='norm'``'s max norm: below every zoo model's gradient norm, so that every step clips (the
#: parity run checks that the reference's norm exceeded it at every step).
CLIP_MAX_NORM = 0.05
#: ``torch.utils.checkpoint`` over the model's innermost units (``harness.engines.activation_checkpointing``).
ActivationCheckpointingName = Literal["none", "non_reentrant", "reentrant"]
#: ``compiled``: the engine's wrapped model under ``torch.compile`` (``harness.compare.compiling``).
CompileName = Literal["none", "compiled"]
#: ``none`` trains straight through; ``full``/``sharded``/``local`` save after step ``checkpoint_step``
#: with that state-dict type, rebuild and resume; ``dcp-reshard`` resumes at another world size.
CheckpointName = Literal["none", "full", "sharded", "local", "dcp-reshard"]

#: id segment of each checkpoint type (``--filter ckpt_`` selects them all).
CHECKPOINT_SEGMENTS: dict[str, str] = {
    "full": "ckpt_full", "sharded": "ckpt_sharded", "local": "ckpt_local", "dcp-reshard": "ckpt_dcp",
}


#: id segment of each training-loop axis value off its default (``--filter clip_`` selects clipped cases).
LOOP_SEGMENTS: dict[str, dict[str, str]] = {
    "clip_grad": {"norm": "clip_norm"},
    "grad_accum": {"no_sync": f"accum{ACCUM_MICRO_BATCHES}_nosync", "sync": f"accum{ACCUM_MICRO_BATCHES}_sync"},
    "activation_checkpointing": {"non_reentrant": "ac_nonreentrant", "reentrant": "ac_reentrant"},
    "compile": {"compiled": "compiled"},
}


def loop_segments(case: "CaseConfig") -> list[str]:
    """The id segments of the training-loop axes a case sets (none at their defaults)."""
    segments = [names[value] for axis, names in LOOP_SEGMENTS.items() if (value := getattr(case, axis)) in names]
    # Another micro-batch count than ACCUM_MICRO_BATCHES (the ``micro_batches`` extra) names its own.
    return [s.replace(f"accum{ACCUM_MICRO_BATCHES}_", f"accum{case.accum_micro_batches}_", 1) for s in segments]


#: Extras the FSDP1 adapter reads (``harness.engines.adapters.FSDP1Adapter``), each with its values, the first the
#: default: how a hybrid case hands its groups to FSDP1 (a ``(shard, replicate)`` pair of process groups, or
#: a 2-D ``(replicate, shard)`` device mesh), and where a checkpointed case's wrapper goes (inside each
#: innermost unit, ``FSDP(checkpoint_wrapper(layer))``, or around it, ``checkpoint_wrapper(FSDP(layer))``,
#: so the recomputed forward runs the unit's hooks again inside backward).
FSDP1_EXTRAS: dict[str, tuple[str, ...]] = {
    "hybrid_groups": ("pair", "mesh"),
    "checkpoint_wrapper": ("inside", "around"),
}


@dataclass(frozen=True)
class PrecisionSpec:
    """What a precision config name means, as dtype names (strings keep this module torch-free)."""

    #: dtype of the master (full-precision) parameters and of the optimizer state.
    full: str
    #: dtype parameters are cast to for compute; None computes in ``full``.
    param: str | None
    #: dtype gradients are reduced in; None means ``param`` if set, else ``full``.
    reduce: str | None
    #: dtype buffers are cast to; None keeps their dtype.
    buffer: str | None

    @property
    def is_mixed(self) -> bool:
        return any(d is not None and d != self.full for d in (self.param, self.reduce, self.buffer))

    @property
    def compute(self) -> str:
        """The dtype forward and backward compute in."""
        return self.param if self.param is not None else self.full

    @property
    def reduced(self) -> str:
        """The dtype gradients are reduced in (``reduce_dtype_default``)."""
        return reduce_dtype_default(self.full, self.param, self.reduce)

    def mixed_precision_kwargs(self) -> dict[str, str | None]:
        """FSDP1's ``MixedPrecision`` keywords, as dtype names (None: FSDP1's default)."""
        return {"param_dtype": self.param, "reduce_dtype": self.reduce, "buffer_dtype": self.buffer}

    def casts(self) -> tuple[str, str, str | None]:
        """What the casts do to the numbers: compute, reduce and buffer dtype (None: buffers keep
        theirs). Two specs with equal ``casts()`` train identically."""
        return self.compute, self.reduced, None if self.buffer in (None, self.full) else self.buffer


#: The precision configs of the matrix; names follow the mixed-precision configs of torch's ``test_fsdp_mixed_precision.py``.
PRECISIONS: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec(full="float32", param=None, reduce=None, buffer=None),
    "fp64": PrecisionSpec(full="float64", param=None, reduce=None, buffer=None),
    "bf16": PrecisionSpec(full="float32", param="bfloat16", reduce="bfloat16", buffer="bfloat16"),
    "fp16": PrecisionSpec(full="float32", param="float16", reduce="float16", buffer="float16"),
    "reduce_only": PrecisionSpec(full="float32", param=None, reduce="float16", buffer=None),
    "param_buffer": PrecisionSpec(full="float32", param="float16", reduce=None, buffer="float16"),
    "fp16_bf16buf_fp32reduce": PrecisionSpec(
        full="float32", param="float16", reduce="float32", buffer="bfloat16"
    ),
}


@dataclass(frozen=True)
class CaseConfig:
    """One configuration to train on an engine and on a reference, compared step by step."""

    #: the engine under test: a name or spec of ``harness.engines.registry`` (``builtin``, ``mine=fsdp1:pkg``);
    #: checked against the registry when cases are selected, resolved again on every rank.
    engine: str = "torch-fsdp"
    #: what the engine is compared against: DDP, or one unsharded process seeing every rank's data.
    reference: ReferenceName = "ddp"
    #: a name from ``harness.cases.models.MODELS``.
    model: str = "nested"
    sharding_strategy: ShardingName = "full_shard"
    precision: PrecisionName = "fp32"
    backward_prefetch: PrefetchName = "none"
    forward_prefetch: bool = False
    cpu_offload: bool = False
    use_orig_params: bool = False
    #: where the model is moved to the device: before wrapping, after wrapping, or never (the
    #: engine's ``device_id`` moves it).
    init_mode: InitModeName = "before"
    world_size: int = 2
    steps: int = 5
    seed: int = 0
    lr: float = 0.01
    #: SGD's momentum (``optimizer='sgd'``); AdamW uses its own betas (``harness.engines.optim``).
    momentum: float = 0.9
    #: the optimizer every side (engine, DDP, local reference) trains with (``harness.engines.optim``).
    optimizer: OptimizerName = "sgd"
    #: save and resume mid-run (see ``CheckpointName``); the resumed run must match the uninterrupted
    #: reference at the case's tolerance.
    checkpoint: CheckpointName = "none"
    #: the engine that loads the checkpoint (another one than ``engine``: cross-engine resume); None
    #: resumes with ``engine``.
    resume_engine: str | None = None
    #: ``dcp-reshard`` only: ``(ranks that save, ranks that resume)``, ranks ``0..n-1`` of the case's
    #: ``world_size`` ranks, which is the larger of the two; 1 resumes on rank 0 as a plain model.
    reshard: tuple[int, ...] = ()
    #: run the case twice and require bitwise-identical results.
    check_determinism: bool = False
    #: delays on the compute stream that turn stream races into failures (``harness.compare.stress``).
    stress: StressName = "none"
    #: gradient clipping before each optimizer step (see ``ClipGradName``).
    clip_grad: ClipGradName = "none"
    #: gradient accumulation over micro-batches (see ``GradAccumName``).
    grad_accum: GradAccumName = "none"
    #: activation checkpointing inside the units (see ``ActivationCheckpointingName``).
    activation_checkpointing: ActivationCheckpointingName = "none"
    #: ``torch.compile`` over the engine's wrapped model (see ``CompileName``).
    compile: CompileName = "none"
    #: free-form extras for adapters and tests (e.g. a fault to inject); must be hashable.
    extras: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.engine, str) or not engine_name(self.engine):
            raise ValueError(f"CaseConfig.engine={self.engine!r} must be an engine name or spec (harness.engines.registry)")
        for field, allowed in FIELD_VALUES.items():
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"CaseConfig.{field}={value!r} is not one of {list(allowed)}")
        if self.world_size < 1:
            raise ValueError(f"CaseConfig.world_size={self.world_size} must be at least 1")
        if self.steps < 1:
            raise ValueError(f"CaseConfig.steps={self.steps} must be at least 1")
        if self.resume_engine is not None and (not isinstance(self.resume_engine, str) or not engine_name(self.resume_engine)):
            raise ValueError(f"CaseConfig.resume_engine={self.resume_engine!r} must be None or an engine name or spec (harness.engines.registry)")
        if self.checkpoint != "none" and self.steps < 2:
            raise ValueError(f"CaseConfig.checkpoint={self.checkpoint!r} needs steps >= 2 (save after one, resume for the rest)")
        if (self.checkpoint == "dcp-reshard") != bool(self.reshard):
            raise ValueError(
                f"CaseConfig.reshard={self.reshard} goes with checkpoint='dcp-reshard' only, and that one needs it "
                f"(e.g. reshard=(2, 4))"
            )
        extra = self.extra
        for name, values in FSDP1_EXTRAS.items():
            if extra.get(name, values[0]) not in values:
                raise ValueError(f"CaseConfig.extras {name}={extra[name]!r} is not one of {list(values)}")
        if "hybrid_groups" in extra and not is_hybrid(self.sharding_strategy):
            raise ValueError(f"CaseConfig.extras hybrid_groups goes with a hybrid sharding_strategy, not {self.sharding_strategy!r}")
        if "checkpoint_wrapper" in extra and self.activation_checkpointing == "none":
            raise ValueError("CaseConfig.extras checkpoint_wrapper needs activation_checkpointing other than 'none'")
        if "micro_batches" in extra and (self.grad_accum == "none" or not isinstance(extra["micro_batches"], int)
                                         or extra["micro_batches"] < 2):
            raise ValueError(f"CaseConfig.extras micro_batches={extra['micro_batches']!r} must be an int of at least 2, "
                             f"with grad_accum 'no_sync' or 'sync' (not {self.grad_accum!r})")
        if self.reshard and (
            len(self.reshard) != 2 or min(self.reshard) < 1 or self.reshard[0] == self.reshard[1]
            or max(self.reshard) != self.world_size
        ):
            raise ValueError(
                f"CaseConfig.reshard={self.reshard} must be (save ranks, resume ranks), two different positive "
                f"counts whose larger one is world_size={self.world_size}"
            )

    @property
    def checkpoint_step(self) -> int:
        """Steps trained before the checkpoint is saved: the first half, rounded down (at least one)."""
        return max(1, self.steps // 2)

    @property
    def accum_micro_batches(self) -> int:
        """Micro-batches per step with ``grad_accum``: the ``micro_batches`` extra, else ``ACCUM_MICRO_BATCHES``."""
        return int(self.extra.get("micro_batches", ACCUM_MICRO_BATCHES))

    def micro_batches(self, step: int) -> list[int]:
        """The batch numbers (``ZooModel.get_input``'s ``step``) of step ``step``'s micro-batches: the step
        itself without accumulation, else ``accum_micro_batches`` batches of their own."""
        if self.grad_accum == "none":
            return [step]
        n = self.accum_micro_batches
        return [step * n + i for i in range(n)]

    @property
    def precision_spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.extras)

    @property
    def case_id(self) -> str:
        """Stable, readable id: ``full_shard-bf16-bwd_pre-fwd_prefetch-offload-orig-transformer``.

        Axes at their default value are left out except strategy, precision and model, so ids stay
        short and do not change when a new axis with a default is added. Two cases that train
        differently have different ids, with engine and reference in ``full_id``; the id leaves out what
        no generator varies (``seed``, ``lr``, ``momentum``), ``check_determinism`` (the same case run
        twice) and the extras but ``shard_size``, ``micro_batches`` and ``FSDP1_EXTRAS`` (a planted fault runs
        the case under its own id).
        """
        parts = [self.sharding_strategy, self.precision, f"bwd_{self.backward_prefetch}"]
        if self.forward_prefetch:
            parts.append("fwd_prefetch")
        if self.cpu_offload:
            parts.append("offload")
        if self.use_orig_params:
            parts.append("orig")
        if self.init_mode != "before":
            parts.append(f"init_{self.init_mode}")
        parts.append(self.model)
        if self.world_size != 2:
            parts.append(f"ws{self.world_size}")
        if self.steps != 5:
            parts.append(f"steps{self.steps}")
        if self.optimizer != "sgd":
            parts.append(self.optimizer)
        if self.checkpoint != "none":
            parts.append(CHECKPOINT_SEGMENTS[self.checkpoint])
        if self.reshard:
            parts.append(f"{self.reshard[0]}to{self.reshard[1]}")
        if self.resume_engine is not None:
            parts.append(f"resume_{self.resume_engine}")
        if self.stress != "none":
            parts.append(f"stress_{self.stress}")
        parts.extend(loop_segments(self))
        if "shard_size" in self.extra:  # a hybrid shard group other than ``harness.ranks.placement.default_shard_size``
            parts.append(f"shard{self.extra['shard_size']}")
        if self.extra.get("hybrid_groups", "pair") != "pair":
            parts.append(f"groups_{self.extra['hybrid_groups']}")
        if self.extra.get("checkpoint_wrapper", "inside") != "inside":
            parts.append(f"ac_{self.extra['checkpoint_wrapper']}_units")
        return "-".join(parts)

    @property
    def full_id(self) -> str:
        """The case id qualified by engine and reference: unique within a results file."""
        return f"{self.engine_name}:{self.reference}:{self.case_id}"

    @property
    def engine_name(self) -> str:
        """The engine's name (``engine`` may be a spec ``NAME=...``)."""
        return engine_name(self.engine)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["extras"] = [list(kv) for kv in self.extras]
        d["reshard"] = list(self.reshard)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaseConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["extras"] = tuple(tuple(kv) for kv in kwargs.get("extras", ()))
        kwargs["reshard"] = tuple(kwargs.get("reshard", ()))
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "CaseConfig":
        return dataclasses.replace(self, **changes)


#: The values of each ``Literal`` field of ``CaseConfig``, in their declared order: what a case accepts,
#: and the order the matrix's axes and the reports' tables list them in.
FIELD_VALUES: dict[str, tuple[str, ...]] = {
    name: get_args(hint) for name, hint in get_type_hints(CaseConfig).items() if get_origin(hint) is Literal
}
