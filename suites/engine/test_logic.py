"""Pure pieces of the runtime, in-process: gradient division factors, execution order,
the all-gather limiter, argument validation, what a unit's configuration decides from its strategy,
public names, and the no-FSDP1-import rule."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import engine
from engine.collectives import predivide_factor
from engine.config import UnitConfig
from engine.flat_param import HandleShardingStrategy
from engine.context import AllGatherLimiter, ExecOrder
from engine.groups import resolve_groups

ENGINE_DIR = pathlib.Path(engine.__file__).parent


@pytest.mark.parametrize("world, pre", [(1, 1.0), (2, 2.0), (4, 2.0), (8, 4.0), (16, 4.0), (6, 4.0)])
def test_predivide_factor_matches_fsdp1(world: int, pre: float) -> None:
    assert predivide_factor(world) == pre


def test_exec_order_prefetch_targets() -> None:
    order = ExecOrder()
    a, b, c = object(), object(), object()
    for u in (a, b, c):
        order.record_pre_forward(u)  # type: ignore[arg-type]
    for u in (b, c, a):  # post-forward order of a nested unit finishing before its parent
        order.record_post_forward(u)  # type: ignore[arg-type]
    assert order.next_forward(a) is None, "no forward prefetch before the order is frozen"
    assert order.next_backward(c) is b and order.next_backward(b) is None
    order.frozen = True
    order.record_pre_forward(object())  # type: ignore[arg-type]
    assert len(order.pre_forward) == 3
    assert order.next_forward(a) is b and order.next_forward(c) is None


class _FakeEvent:
    def __init__(self, log: list[int], i: int) -> None:
        self.log, self.i = log, i

    def synchronize(self) -> None:
        self.log.append(self.i)


def test_limiter_waits_for_the_oldest_free_one_per_all_gather() -> None:
    """torch FSDP1's rule: with ``max_in_flight`` frees pending an all-gather waits for the oldest only, so the
    17 frees of a SHARD_GRAD_OP backward are not all waited for by the next forward's first all-gather."""
    log: list[int] = []
    limiter = AllGatherLimiter(enabled=True, max_in_flight=2)
    limiter._free_events.extend(_FakeEvent(log, i) for i in range(17))
    limiter.wait_if_needed()
    assert log == [0] and len(limiter) == 16
    for _ in range(15):
        limiter.wait_if_needed()
    assert log == list(range(16)) and len(limiter) == 1
    limiter.wait_if_needed()  # fewer than max_in_flight pending: no wait
    assert log == list(range(16)) and len(limiter) == 1
    disabled = AllGatherLimiter(enabled=False)
    disabled._free_events.extend(_FakeEvent(log, i) for i in range(5))
    disabled.wait_if_needed()
    assert log == list(range(16))
    disabled.record_free(torch.device("cpu"))  # a no-op off CUDA


def test_process_group_and_device_mesh_conflict() -> None:
    with pytest.raises(ValueError, match="both process_group and device_mesh"):
        resolve_groups(engine.ShardingStrategy.FULL_SHARD, object(), object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "strategy, sharded, hybrid, reshard_after_forward",
    [
        ("FULL_SHARD", True, False, True),
        ("SHARD_GRAD_OP", True, False, False),
        ("NO_SHARD", False, False, False),
        ("HYBRID_SHARD", True, True, True),
        ("_HYBRID_SHARD_ZERO2", True, True, False),
    ],
)
def test_unit_config_decides_from_the_strategy(strategy: str, sharded: bool, hybrid: bool, reshard_after_forward: bool) -> None:
    group = object()
    config = UnitConfig(engine.ShardingStrategy[strategy], torch.device("cpu"), group, group if hybrid else None)
    assert (config.sharded, config.hybrid, config.reshard_after_forward) == (sharded, hybrid, reshard_after_forward)
    # The handle's strategy argument (torch FSDP1's HandleShardingStrategy) is the same enum.
    assert HandleShardingStrategy[strategy] is engine.ShardingStrategy[strategy]


def test_unit_config_refuses_a_replicate_group_without_a_hybrid_strategy() -> None:
    with pytest.raises(ValueError, match="replicate_group is only valid with a hybrid strategy"):
        UnitConfig(engine.ShardingStrategy.FULL_SHARD, torch.device("cpu"), object(), object())
    with pytest.raises(ValueError, match="must be a ShardingStrategy member"):
        UnitConfig("FULL_SHARD", torch.device("cpu"), object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (engine.ShardingStrategy, torch_fsdp.ShardingStrategy),
        (engine.BackwardPrefetch, torch_fsdp.BackwardPrefetch),
        (engine.StateDictType, torch_fsdp.StateDictType),
    ],
)
def test_enum_members_are_fsdp1s(ours, theirs) -> None:
    assert [m.name for m in ours] == [m.name for m in theirs]


def test_config_fields_are_fsdp1s() -> None:
    import dataclasses

    for ours, theirs in [(engine.MixedPrecision, torch_fsdp.MixedPrecision), (engine.CPUOffload, torch_fsdp.CPUOffload)]:
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]


def test_engine_never_imports_torch_fsdp() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+torch\.distributed\.fsdp", re.MULTILINE)
    offenders = [p.name for p in ENGINE_DIR.glob("*.py") if pattern.search(p.read_text())]
    assert not offenders, f"engine modules mention torch.distributed.fsdp: {offenders}"
    code = (
        "import sys, engine, engine.wrap, engine.state, engine.summon, engine.grad_norm; "
        "bad = [m for m in sys.modules if m.startswith('torch.distributed.fsdp')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ENGINE_DIR.parent)
