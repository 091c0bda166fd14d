"""Checking and normalising the arguments of ``FullyShardedDataParallel`` and its utilities.

Every argument is checked before anything changes (no module wrapped, no parameter moved); a
wrong one is a ``ValueError`` that names the parameter, what it got and the type it needs.

torch FSDP1's own enums and configuration dataclasses (``torch.distributed.fsdp.ShardingStrategy``,
``BackwardPrefetch``, ``MixedPrecision``, ``CPUOffload``, ``StateDictType`` and the state-dict
configurations, whose conversion lives in :mod:`engine.state_dict_config`) are accepted as their
equivalents, so code written for torch FSDP1 runs by
changing only its import, and code mixing both works. They are recognised by duck typing (the
class name, a defining module under ``torch.distributed.fsdp``, the enum member's ``name``, the
dataclass fields): the engine never imports ``torch.distributed.fsdp``.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, NamedTuple, TypeVar

import torch

from engine.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)

__all__ = [
    "Arguments",
    "as_backward_prefetch",
    "as_dataclass",
    "as_cpu_offload",
    "as_device_id",
    "as_mixed_precision",
    "as_sharding_strategy",
    "as_state_dict_type",
    "check_process_group",
    "is_torch_fsdp_object",
    "normalize_arguments",
]

#: where torch FSDP1 defines its public enums and configurations.
TORCH_FSDP_MODULE = "torch.distributed.fsdp"

E = TypeVar("E", bound=Enum)
D = TypeVar("D")


def is_torch_fsdp_object(value: Any, class_name: str) -> bool:
    """Whether ``value`` is an instance of torch FSDP1's class ``class_name`` (by name and module)."""
    cls = type(value)
    return cls.__name__ == class_name and getattr(cls, "__module__", "").startswith(TORCH_FSDP_MODULE)


def _describe(value: Any) -> str:
    return f"{value!r} (a {type(value).__module__}.{type(value).__qualname__})"


def _as_enum(value: Any, enum: type[E], param: str) -> E:
    if isinstance(value, enum):
        return value
    if is_torch_fsdp_object(value, enum.__name__) and getattr(value, "name", None) in enum.__members__:
        return enum[value.name]
    members = ", ".join(f"{enum.__name__}.{m}" for m in enum.__members__)
    raise ValueError(
        f"{param}={_describe(value)} must be a {enum.__name__} member ({members}), from engine or "
        f"{TORCH_FSDP_MODULE}"
    )


def as_dataclass(value: Any, cls: type[D], param: str, hint: str = "") -> D:
    """``value`` as ``cls``: itself, or torch FSDP1's dataclass of the same name field by field.

    The one converter of torch's configurations (constructor arguments and state-dict settings).
    A public field of torch's class that ours lacks must be at its default; private ones (torch's
    bookkeeping, such as ``_use_dtensor``) are dropped.
    """
    if isinstance(value, cls):
        return value
    if is_torch_fsdp_object(value, cls.__name__) and dataclasses.is_dataclass(value):
        ours = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs = {}
        for f in dataclasses.fields(value):
            current = getattr(value, f.name)
            if f.name in ours:
                kwargs[f.name] = current
            elif not f.name.startswith("_") and f.default is not dataclasses.MISSING and current != f.default:
                raise ValueError(
                    f"{param}: torch's {cls.__name__}.{f.name}={current!r} has no equivalent in this "
                    f"engine; leave it at its default ({f.default!r})"
                )
        return cls(**kwargs)
    raise ValueError(
        f"{param}={_describe(value)} must be a {cls.__name__} (from engine or {TORCH_FSDP_MODULE})"
        + (f"{hint}" if hint else "")
    )


def as_sharding_strategy(value: Any) -> ShardingStrategy:
    """``sharding_strategy``: None means FULL_SHARD."""
    return ShardingStrategy.FULL_SHARD if value is None else _as_enum(value, ShardingStrategy, "sharding_strategy")


def as_backward_prefetch(value: Any) -> BackwardPrefetch | None:
    return None if value is None else _as_enum(value, BackwardPrefetch, "backward_prefetch")


def as_state_dict_type(value: Any) -> StateDictType:
    return _as_enum(value, StateDictType, "state_dict_type")


def as_cpu_offload(value: Any) -> CPUOffload:
    """``cpu_offload``: None means no offload; a bare bool is refused (FSDP1 takes a CPUOffload)."""
    if value is None:
        return CPUOffload()
    hint = ""
    if isinstance(value, bool):
        hint = f"; pass CPUOffload(offload_params={value}) instead of a bool"
    return as_dataclass(value, CPUOffload, "cpu_offload", hint)


def _check_dtype(value: Any, param: str) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        hint = ""
        if isinstance(value, str):
            candidate = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(value, value)
            if isinstance(getattr(torch, candidate, None), torch.dtype):
                hint = f" (e.g. torch.{candidate}, not the string {value!r})"
        raise ValueError(f"{param}={_describe(value)} must be a torch.dtype or None{hint}")


def as_mixed_precision(value: Any) -> MixedPrecision | None:
    """``mixed_precision``: None, or a MixedPrecision whose dtypes are ``torch.dtype`` or None."""
    if value is None:
        return None
    hint = ""
    if isinstance(value, torch.dtype):
        hint = f"; for one dtype everywhere pass MixedPrecision(param_dtype={value}, reduce_dtype={value})"
    elif isinstance(value, dict):
        hint = "; build MixedPrecision(**your_dict) instead of passing a dict"
    mp = as_dataclass(value, MixedPrecision, "mixed_precision", hint)
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        _check_dtype(getattr(mp, field), f"MixedPrecision.{field}")
    return mp


def _is_group(value: Any) -> bool:
    # A real ProcessGroup, or a double with what the engine asks of one.
    return callable(getattr(value, "rank", None)) and callable(getattr(value, "size", None))


def check_process_group(value: Any) -> None:
    """``process_group``: None, a process group, or ``(shard group, replicate group)``."""
    if value is None or _is_group(value):
        return
    if isinstance(value, tuple) and all(_is_group(g) for g in value):
        return
    raise ValueError(
        f"process_group={_describe(value)} must be a torch.distributed.ProcessGroup (e.g. from "
        "dist.new_group(...)), a tuple (shard_group, replicate_group) for a hybrid strategy, or None; "
        "a backend name selects nothing here: pass it to dist.init_process_group or dist.new_group"
    )


def as_device_id(value: Any) -> torch.device | None:
    """``device_id``: None, a device index (CUDA), a ``torch.device`` or a device string."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise ValueError(f"device_id={_describe(value)} must be an int (CUDA device index), a torch.device or None")
    try:
        device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device_id={value!r} is not a device: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device_id={value!r} names a CUDA device but CUDA is not available here: pass "
                "device_id=None (or torch.device('cpu')) to compute on the CPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device_id={value!r}: there are only {torch.cuda.device_count()} CUDA devices here"
            )
    return device


def _as_flag(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{param}={_describe(value)} must be a bool")
    return value


class Arguments(NamedTuple):
    """The constructor's arguments after checking, in the engine's own types."""

    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload
    backward_prefetch: BackwardPrefetch | None
    mixed_precision: MixedPrecision | None
    device_id: torch.device | None
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool


def normalize_arguments(
    *,
    process_group: Any,
    sharding_strategy: Any,
    cpu_offload: Any,
    backward_prefetch: Any,
    mixed_precision: Any,
    device_id: Any,
    sync_module_states: Any,
    forward_prefetch: Any,
    limit_all_gathers: Any,
    use_orig_params: Any,
) -> Arguments:
    """Check every argument of ``FullyShardedDataParallel`` that has a fixed type; raise the first
    ``ValueError`` found, before the caller changes anything."""
    check_process_group(process_group)
    return Arguments(
        sharding_strategy=as_sharding_strategy(sharding_strategy),
        cpu_offload=as_cpu_offload(cpu_offload),
        backward_prefetch=as_backward_prefetch(backward_prefetch),
        mixed_precision=as_mixed_precision(mixed_precision),
        device_id=as_device_id(device_id),
        sync_module_states=_as_flag(sync_module_states, "sync_module_states"),
        forward_prefetch=_as_flag(forward_prefetch, "forward_prefetch"),
        limit_all_gathers=_as_flag(limit_all_gathers, "limit_all_gathers"),
        use_orig_params=_as_flag(use_orig_params, "use_orig_params"),
    )
