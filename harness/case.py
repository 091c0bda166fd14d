"""The neutral description of one parity case.

A case is plain, picklable, hashable data: the matrix generator produces them, the pool ships
them to every rank, the adapters translate them into each engine's native options, and the
collector records them. Nothing in here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

EngineName = Literal["builtin", "torch-fsdp", "torch-fsdp2"]
ReferenceName = Literal["ddp", "local"]
ShardingName = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]
PrecisionName = Literal[
    "fp32", "fp64", "bf16", "fp16", "reduce_only", "param_buffer", "fp16_bf16buf_fp32reduce"
]
PrefetchName = Literal["none", "pre", "post"]
InitModeName = Literal["before", "after", "never"]
OptimizerName = Literal["sgd", "adamw"]
#: ``none`` trains straight through; ``full``/``sharded``/``local`` save after step ``checkpoint_step``
#: with that state-dict type, rebuild and resume; ``dcp-reshard`` resumes at another world size.
CheckpointName = Literal["none", "full", "sharded", "local", "dcp-reshard"]

#: id segment of each checkpoint type (``--filter ckpt_`` selects them all).
CHECKPOINT_SEGMENTS: dict[str, str] = {
    "full": "ckpt_full", "sharded": "ckpt_sharded", "local": "ckpt_local", "dcp-reshard": "ckpt_dcp",
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


#: The precision configs of the matrix; names follow the seed's mixed-precision configs.
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

    #: the engine under test.
    engine: EngineName = "torch-fsdp"
    #: what the engine is compared against: DDP, or one unsharded process seeing every rank's data.
    reference: ReferenceName = "ddp"
    #: a name from ``harness.models.MODELS``.
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
    #: SGD's momentum (``optimizer='sgd'``); AdamW uses its own betas (``harness.optim``).
    momentum: float = 0.9
    #: the optimizer every side (engine, DDP, local reference) trains with (``harness.optim``).
    optimizer: OptimizerName = "sgd"
    #: save and resume mid-run (see ``CheckpointName``); the resumed run must match the uninterrupted
    #: reference at the case's tolerance.
    checkpoint: CheckpointName = "none"
    #: the engine that loads the checkpoint (another one than ``engine``: cross-engine resume); None
    #: resumes with ``engine``.
    resume_engine: EngineName | None = None
    #: ``dcp-reshard`` only: ``(ranks that save, ranks that resume)``, ranks ``0..n-1`` of the case's
    #: ``world_size`` ranks, which is the larger of the two; 1 resumes on rank 0 as a plain model.
    reshard: tuple[int, ...] = ()
    #: run the case twice and require bitwise-identical results.
    check_determinism: bool = False
    #: free-form extras for adapters and tests (e.g. a fault to inject); must be hashable.
    extras: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for field, allowed in (
            ("engine", get_args(EngineName)),
            ("reference", get_args(ReferenceName)),
            ("sharding_strategy", get_args(ShardingName)),
            ("precision", get_args(PrecisionName)),
            ("backward_prefetch", get_args(PrefetchName)),
            ("init_mode", get_args(InitModeName)),
            ("optimizer", get_args(OptimizerName)),
            ("checkpoint", get_args(CheckpointName)),
        ):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"CaseConfig.{field}={value!r} is not one of {list(allowed)}")
        if self.world_size < 1:
            raise ValueError(f"CaseConfig.world_size={self.world_size} must be at least 1")
        if self.steps < 1:
            raise ValueError(f"CaseConfig.steps={self.steps} must be at least 1")
        if self.resume_engine is not None and self.resume_engine not in get_args(EngineName):
            raise ValueError(f"CaseConfig.resume_engine={self.resume_engine!r} is not None or one of {list(get_args(EngineName))}")
        if self.checkpoint != "none" and self.steps < 2:
            raise ValueError(f"CaseConfig.checkpoint={self.checkpoint!r} needs steps >= 2 (save after one, resume for the rest)")
        if (self.checkpoint == "dcp-reshard") != bool(self.reshard):
            raise ValueError(
                f"CaseConfig.reshard={self.reshard} goes with checkpoint='dcp-reshard' only, and that one needs it "
                f"(e.g. reshard=(2, 4))"
            )
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
    def precision_spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.extras)

    @property
    def case_id(self) -> str:
        """Stable, readable id: ``full_shard-bf16-bwd_pre-fwd_prefetch-offload-orig-transformer``.

        Axes at their default value are left out except strategy, precision and model, so ids stay
        short and do not change when a new axis with a default is added.
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
        return "-".join(parts)

    @property
    def full_id(self) -> str:
        """The case id qualified by engine and reference: unique within a results file."""
        return f"{self.engine}:{self.reference}:{self.case_id}"

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
