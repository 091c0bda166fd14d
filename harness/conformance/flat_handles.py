"""Flat-parameter handles built in one process for any rank: what the flat-parameter properties
(``harness.conformance.flat_param_properties``) and the flat-parameter suites build handles with.

Everything here lets one process look at any rank of any world size: the project's one process-group
double (:class:`DummyProcessGroup`: ``rank()`` and ``size()`` are all a handle's constructor asks of a
group, ours and torch FSDP1's), handle construction
with FSDP1's argument names over it, and putting a module tree's parameters back after a handle has
rewired them, so that one module serves a handle per rank.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch import Tensor

from engine.flat_param import HandleShardingStrategy
from harness.cases.case import FSDP1_STRATEGIES, ShardingName
from harness.conformance.flat_cases import BITS_DTYPE, FlatCase


class DummyProcessGroup:
    """A process-group test double: only ``rank()`` and ``size()``, no communication."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def flatten_params_transformer(seed: int = 0, *, shared: bool = False) -> nn.Transformer:
    """The transformer of torch's test_fsdp_flatten_params.py (narrower: ``d_model=16``, two heads) with a
    buffer; ``shared`` ties the feed-forward weights of encoder layer i and decoder layer i, so a handle
    sees parameters registered twice."""
    torch.manual_seed(seed)
    module = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, dropout=0.1)
    module.register_buffer("dummy_buffer", torch.tensor(1.0))
    if shared:
        for enc_layer, dec_layer in zip(module.encoder.layers, module.decoder.layers):
            dec_layer.linear1.weight = enc_layer.linear1.weight
            dec_layer.linear2.weight = enc_layer.linear2.weight
    return module


def handle_kwargs(
    *,
    rank: int,
    world_size: int,
    use_orig_params: bool,
    sharding: ShardingName = "full_shard",
    mp_param_dtype: torch.dtype | None = None,
    mp_reduce_dtype: torch.dtype | None = None,
    strategy_enum: Any = HandleShardingStrategy,
) -> dict[str, Any]:
    """Constructor arguments (FSDP1's names) for a CPU handle of ``rank`` in ``world_size``.

    ``strategy_enum`` is the sharding-strategy enum of the implementation being built (ours or
    torch's): the two enums are distinct types with the same member names.
    """
    return {
        "device": torch.device("cpu"),
        "sharding_strategy": strategy_enum[FSDP1_STRATEGIES[sharding]],
        "offload_params": False,
        "mp_param_dtype": mp_param_dtype,
        "mp_reduce_dtype": mp_reduce_dtype,
        "keep_low_precision_grads": False,
        "process_group": DummyProcessGroup(rank, world_size),
        "use_orig_params": use_orig_params,
        "fsdp_extension": None,
    }


def case_kwargs(case: FlatCase, rank: int, strategy_enum: Any = HandleShardingStrategy) -> dict[str, Any]:
    return handle_kwargs(
        rank=rank,
        world_size=case.world_size,
        use_orig_params=case.use_orig_params,
        sharding=case.sharding,
        mp_param_dtype=case.mp_param_dtype,
        mp_reduce_dtype=case.mp_reduce_dtype,
        strategy_enum=strategy_enum,
    )


class Registrations:
    """Every ``(module, attribute) -> Parameter`` registration of a tree, and each parameter's data.

    A handle replaces registered parameters by views and, with ``use_orig_params``, rebinds their
    ``.data`` to shard views; :meth:`restore` undoes both, so the next handle sees the tree as built.
    """

    def __init__(self, root: nn.Module) -> None:
        #: ``(module, attribute name, Parameter)`` for every registration, shared ones included.
        self.entries = [
            (module, name, param)
            for _, module in root.named_modules(remove_duplicate=False)
            for name, param in module._parameters.items()
            if param is not None
        ]
        self._data = {id(p): (p, p.data) for _, _, p in self.entries}

    def restore(self) -> None:
        for module, name, param in self.entries:
            module.__dict__.pop(name, None)
            module._parameters[name] = param
        for param, data in self._data.values():
            param.data = data


def bits(t: Tensor) -> Tensor:
    """``t`` reinterpreted as integers of the same width: equality on it is bitwise equality."""
    return t.view(BITS_DTYPE[t.dtype])


def storage_order(t: Tensor) -> Tensor:
    """``t``'s elements in the order they sit in memory, computed from shape and strides alone.

    This is the order a flat parameter holds a parameter's elements in; it is computed here by
    brute force (every element's storage position, then a sort) so that it shares nothing with the
    ``as_strided`` shortcut the implementations use.
    """
    position = torch.zeros(t.shape, dtype=torch.long)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        position = position + torch.arange(size).view(shape) * stride
    position = position.reshape(-1)
    order = position.argsort()
    # Dense and non-overlapping: the positions are exactly 0..numel-1.
    assert torch.equal(position[order], torch.arange(t.numel())), f"strides {t.stride()} are not dense"
    return t.reshape(-1)[order]


def shard_per_rank(
    module: nn.Module,
    case: FlatCase,
    make: Callable[..., Any],
    ranks: range | list[int],
    strategy_enum: Any = HandleShardingStrategy,
) -> list[Any]:
    """One *sharded* handle of ``make`` (a handle class) per rank in ``ranks``, all over ``module``.

    The module is put back as built before each construction and after the last one.
    """
    registrations = Registrations(module)
    handles = []
    for rank in ranks:
        registrations.restore()
        handle = make(list(module.parameters()), module, **case_kwargs(case, rank, strategy_enum))
        handle.shard()
        handles.append(handle)
    registrations.restore()
    return handles
