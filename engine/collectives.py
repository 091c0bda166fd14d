"""Stateless communication for the runtime: all-gather parameters, reduce gradients.

Every function takes the group, the stream to run on (None on CPU, where everything is
synchronous) and the tensors, and returns a result record whose CUDA event marks completion on
that stream; the caller makes its compute stream wait on the event before using the result.

The collectives are looked up on the ``torch.distributed`` module at call time
(``dist.all_gather_into_tensor`` ...), so a test or the harness can patch them there to trace
which ops run, on which dtypes and sizes.

[Note: stream ordering]
- Gradient reductions first make their stream wait for the current stream, which produced the
  gradient (:func:`stream_context`).
- All-gathers do not wait: the shards they read change only between iterations (optimizer step,
  user writes adopted at root pre-forward), so the caller orders the all-gather stream after the
  compute stream once, when a shard may have changed (``Streams.gather_after_compute``), as FSDP1
  does at its root pre-forward. Waiting per all-gather would start every gather only after all
  compute issued so far, serializing each unit's gather behind the previous unit's forward.
- Tensors allocated on one stream and consumed on another are passed through ``record_stream``
  so the caching allocator does not hand their memory out before the consumer is done.
- NCCL collectives issued under ``torch.cuda.stream(s)`` are ordered with ``s``: a synchronous
  collective makes ``s`` wait on NCCL's internal stream.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "AllGatherResult",
    "comm_device",
    "device_types_of",
    "staged",
    "ReduceResult",
    "all_gather_flat",
    "copy_flat",
    "reduce_scatter_grad",
    "all_reduce_grad",
    "average_factors",
    "averages_in_the_collective",
    "chunk_output",
    "record_event",
    "reduction_input",
    "predivide_factor",
    "stream_context",
]

# torch 2.13 deprecates reduce_scatter_tensor/all_gather_into_tensor in favour of *_single, which
# torch 2.11 lacks; the deprecated names are the ones both versions have.
warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor).* is deprecated")


def device_types_of(backend: str) -> frozenset[str]:
    """The device types whose tensors a backend's collectives take: ``nccl`` only ``cuda``, ``gloo``
    ``cpu`` and ``cuda``, a ``cpu:gloo,cuda:nccl`` group both; a backend torch does not know, any."""
    if ":" in backend:
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(","))
    known = dist.Backend.backend_capability.get(backend.lower())
    return frozenset(known) if known else frozenset({"cpu", "cuda"})


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a collective over ``group`` takes a tensor that lives on ``device``.

    [Note: CPU tensors on accelerator groups]
    NCCL refuses CPU tensors, which gloo takes: offloaded parameters, optimizer state loaded to the
    CPU and CPU state dicts must travel through the group's accelerator (torch FSDP1 does the same
    through its compute device). A check on CPU ranks cannot see this, so every collective on values
    that may live on the CPU goes through :func:`staged`, which a CPU test replaces to prove it.
    """
    backend = str(dist.get_backend(group))
    types = device_types_of(backend)
    if device.type in types:
        return device
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None and bound.type in types:
        return bound
    for kind in sorted(types - {"cpu"}):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return torch.device(kind, module.current_device())
    raise RuntimeError(
        f"process group backend {backend!r} takes {sorted(types)} tensors, not {device.type} ones, and this "
        f"process has no such device to stage them on: run the ranks on {sorted(types)} devices or use gloo"
    )


def staged(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``tensor`` on the device ``group``'s collectives take: itself when it is there already, else a
    copy ([Note: CPU tensors on accelerator groups]); the caller copies results back."""
    device = comm_device(group, tensor.device)
    return tensor if tensor.device == device else tensor.to(device)


class AllGatherResult(NamedTuple):
    """The unsharded buffer after the gather and the event that marks it complete (None on CPU)."""

    output: Tensor
    event: torch.cuda.Event | None


class ReduceResult(NamedTuple):
    """This rank's reduced gradient (in the reduce dtype) and the event that marks it complete."""

    grad: Tensor
    event: torch.cuda.Event | None


@contextlib.contextmanager
def stream_context(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on ``stream`` after it waits for the current stream; no-op for None (CPU)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on ``stream`` without waiting for the current stream; no-op for None (CPU)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def predivide_factor(world_size: int) -> float:
    """FSDP1's split of the gradient average into a division before and after the reduction
    (keeps low-precision sums from overflowing); the post factor is ``world_size / pre``."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def _group_size(group: dist.ProcessGroup | None) -> int:
    """``dist.get_world_size(group)`` for a group this rank is in: the group's own ``size()``, without the
    public function's checks and lookups (asked for every unit at every all-gather and reduction)."""
    return group.size() if group is not None else dist.get_world_size()


def _prepare_shard(shard: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The shard on the compute device in the compute dtype (a copy only when it must move or cast)."""
    if shard.device == device and shard.dtype == dtype:
        return shard
    return shard.to(device=device, dtype=dtype, non_blocking=True)


def all_gather_flat(
    shard: Tensor,
    alloc_output: Callable[[], Tensor],
    group: dist.ProcessGroup,
    stream: torch.cuda.Stream | None,
    device: torch.device,
    dtype: torch.dtype,
) -> AllGatherResult:
    """All-gather every rank's equal ``shard`` into the buffer ``alloc_output()`` returns.

    ``alloc_output`` runs on ``stream`` so the unsharded storage is allocated there; the shard is
    moved to ``device`` and cast to ``dtype`` on the way (CPU offload, mixed precision). The
    caller has ordered ``stream`` after the last write of the shard ([Note: stream ordering]).
    """
    with _on_stream(stream):
        local = _prepare_shard(shard.detach(), device, dtype)
        output = alloc_output()
        world_size = _group_size(group)
        if output.numel() != local.numel() * world_size:
            raise RuntimeError(
                f"all-gather output has {output.numel()} elements but {world_size} shards of "
                f"{local.numel()} need {local.numel() * world_size}"
            )
        dist.all_gather_into_tensor(output, local, group=group)
        event = record_event(stream)
    return AllGatherResult(output, event)


def copy_flat(
    flat: Tensor,
    alloc_output: Callable[[], Tensor],
    stream: torch.cuda.Stream | None,
) -> AllGatherResult:
    """The unsharded buffer of a NO_SHARD unit that computes in another dtype or device: a copy
    (ordered by the caller, as :func:`all_gather_flat`)."""
    with _on_stream(stream):
        output = alloc_output()
        output.copy_(flat.detach(), non_blocking=True)
        event = record_event(stream)
    return AllGatherResult(output, event)


def _div_(t: Tensor, factor: float) -> None:
    if factor > 1:
        t.div_(factor)


def average_factors(dp_size: int) -> tuple[float, float]:
    """The division before and after the reduction whose product is ``dp_size``."""
    pre = predivide_factor(dp_size)
    return pre, dp_size / pre


def averages_in_the_collective(group: dist.ProcessGroup | None, tensor: Tensor) -> bool:
    """Whether NCCL averages ``tensor`` over ``group`` itself (``ReduceOp.AVG``), as torch FSDP2 does for fp32
    and bf16: no division kernels beside the collective, whose memory traffic on the reduction stream
    competes with the backward's. Gloo has no AVG, and fp16 keeps FSDP1's division before and after (its
    sums would overflow). At one rank there is nothing to average (NCCL's AVG is unreliable there)."""
    return (tensor.is_cuda and tensor.dtype in (torch.float32, torch.bfloat16) and _group_size(group) > 1
            and "nccl" in str(dist.get_backend(group)))


def reduction_input(grad: Tensor, reduce_dtype: torch.dtype, stream: torch.cuda.Stream | None) -> Tensor:
    """The gradient to reduce, in the reduce dtype, safe to use on ``stream``. The caller hands the
    unsharded gradient over: without a cast it is reduced (divided) in place, saving a copy."""
    grad = grad.detach()
    if stream is not None:
        # Produced on the compute stream, consumed on ``stream``.
        grad.record_stream(stream)
    return grad.to(reduce_dtype)


def chunk_output(grad: Tensor, world_size: int, what: str) -> Tensor:
    """An empty tensor for this rank's chunk of ``grad``, which must be padded to ``world_size``
    equal chunks (the layout pads every flat parameter so)."""
    if grad.numel() % world_size:
        raise RuntimeError(
            f"{what} input of {grad.numel()} elements is not padded to a multiple of world_size={world_size}"
        )
    return grad.new_empty(grad.numel() // world_size)


def reduce_scatter_grad(
    unsharded_grad: Tensor,
    group: dist.ProcessGroup,
    replicate_group: dist.ProcessGroup | None,
    reduce_dtype: torch.dtype,
    stream: torch.cuda.Stream | None,
) -> ReduceResult:
    """Average ``unsharded_grad`` (padded to ``world_size`` equal chunks) over the data-parallel
    ranks and return this rank's chunk.

    With ``replicate_group`` (hybrid sharding) the reduce-scattered chunk is then all-reduced
    across replicas; the average is over shard x replicate ranks.
    """
    world_size = _group_size(group)
    dp_size = world_size * (_group_size(replicate_group) if replicate_group is not None else 1)
    pre, post = average_factors(dp_size)
    with stream_context(stream):
        grad = reduction_input(unsharded_grad, reduce_dtype, stream)
        output = chunk_output(grad, world_size, "reduce-scatter")
        if averages_in_the_collective(group, grad) and (replicate_group is None
                                                        or averages_in_the_collective(replicate_group, grad)):
            # The average of the shard group's averages is the average over all dp_size ranks.
            dist.reduce_scatter_tensor(output, grad, op=dist.ReduceOp.AVG, group=group)
            if replicate_group is not None:
                dist.all_reduce(output, op=dist.ReduceOp.AVG, group=replicate_group)
        else:
            _div_(grad, pre)
            dist.reduce_scatter_tensor(output, grad, group=group)
            if replicate_group is not None:
                dist.all_reduce(output, group=replicate_group)
            _div_(output, post)
        event = record_event(stream)
    return ReduceResult(output, event)


def all_reduce_grad(
    grad: Tensor,
    group: dist.ProcessGroup,
    reduce_dtype: torch.dtype,
    stream: torch.cuda.Stream | None,
) -> ReduceResult:
    """Average ``grad`` over ``group`` (NO_SHARD), in the reduce dtype (in place when ``grad``
    already has it: the caller hands it over)."""
    pre, post = average_factors(_group_size(group))
    with stream_context(stream):
        out = reduction_input(grad, reduce_dtype, stream)
        if averages_in_the_collective(group, out):
            dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
        else:
            _div_(out, pre)
            dist.all_reduce(out, group=group)
            _div_(out, post)
        event = record_event(stream)
    return ReduceResult(out, event)
