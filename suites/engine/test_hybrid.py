"""HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 4 CPU ranks (2 replicas x 2 shards), against the
all-data local reference and DDP, with groups passed as a pair, built from a 2-D mesh, and the
default groups (a node of the launcher's ``LOCAL_WORLD_SIZE`` ranks).

The parity checks are harness cases on the plugin's 4-rank pool (``test_hybrid_parity``); the checks of one rank
rank checks below look at what parity does not: where the shards live, the clip norm, module-state sync and
the default groups.
"""

from __future__ import annotations

import itertools
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from engine import FSDP, ShardingStrategy
from harness.cases.case import HYBRID_STRATEGIES, CaseConfig
from harness.cases.model_protocol import wrap_bottom_up
from harness.conformance.engine_models import NESTED, TRANSFORMER, NestedWrapped
from harness.conformance.fsdp1_checks import all_data, assert_match
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.pytest_plugin import ParityRunner
from harness.ranks.rank import new_hybrid_groups

CPU = torch.device("cpu")
HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
HYBRID_CASE = CaseConfig(engine="builtin", world_size=4)


def _cases(smoke: bool = False) -> list[CaseConfig]:
    """Groups as a pair (shard groups {0,1} {2,3}, replicate groups {0,2} {1,3}): strategy x
    use_orig_params x backward prefetch on the nested and transformer models, each combination against
    one reference and the other model against the other (``smoke``, the CI tier: 4 combinations that show
    every value with both references); groups from a 2-D ``(replicate, shard)`` mesh with forward
    prefetch; accumulation inside no_sync."""
    cases = []
    combos = itertools.product(enumerate(HYBRID_STRATEGIES), [False, True], enumerate(["none", "pre", "post"]))
    for i, ((s, strategy), orig, (p, prefetch)) in enumerate(combos):
        if smoke and p != (2 * s + orig) % 3:
            continue
        pair = HYBRID_CASE.replace(sharding_strategy=strategy, use_orig_params=orig, backward_prefetch=prefetch)
        cases.append(pair.replace(model=NESTED, reference="ddp" if i % 2 else "local"))
        cases.append(pair.replace(model=TRANSFORMER, reference="local" if i % 2 else "ddp"))
    for strategy, orig in itertools.product(HYBRID_STRATEGIES, [False, True]):
        cases.append(HYBRID_CASE.replace(sharding_strategy=strategy, use_orig_params=orig, forward_prefetch=True,
                                         model=NESTED, reference="local", extras=(("hybrid_groups", "mesh"),)))
    for strategy in HYBRID_STRATEGIES:
        cases.append(HYBRID_CASE.replace(sharding_strategy=strategy, model=NESTED, reference="local",
                                         grad_accum="no_sync"))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``case``: the lane's hybrid cases (``--matrix``: smoke in CI, every combination in the others)."""
    if "case" in metafunc.fixturenames:
        cases = _cases(smoke=metafunc.config.getoption("matrix") == "smoke")
        metafunc.parametrize("case", cases, ids=[c.full_id for c in cases])


def test_hybrid_parity(case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(case)


def test_the_smoke_cases_show_every_value_with_both_references() -> None:
    smoke, every = _cases(smoke=True), _cases()
    assert len(smoke) == 14 and len(every) == 30 and set(smoke) <= set(every)
    pair = [c for c in smoke if not c.extras and c.grad_accum == "none"]
    for axis in ("sharding_strategy", "use_orig_params", "backward_prefetch"):
        assert {getattr(c, axis) for c in pair} == {getattr(c, axis) for c in every}, axis
    assert {(c.model, c.reference) for c in pair} == {(m, r) for m in (NESTED, TRANSFORMER) for r in ("ddp", "local")}


def _pair_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Shard groups {0,1} {2,3}, replicate groups {0,2} {1,3} (every rank creates all)."""
    return new_hybrid_groups(dist.get_rank(), 4, 2)


def check_hybrid_shards_within_group(rank: int, world_size: int) -> None:
    model = FSDP(NestedWrapped(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=_pair_groups())
    flat = model.module._flat_param
    total = sum(p.numel() for p in NestedWrapped().parameters())
    assert flat.numel() == -(-total // 2), f"sharded over the 2-rank shard group, got {flat.numel()} of {total}"


def check_hybrid_clip_norm(rank: int, world_size: int) -> None:
    """The total norm clip_grad_norm_ returns over the shard and replicate groups, against the unwrapped
    model's over every rank's batch."""
    groups = _pair_groups()
    for strategy in HYBRID:
        ref = NestedWrapped()
        model = wrap_bottom_up(NestedWrapped(), FSDP, sharding_strategy=strategy, process_group=groups)
        inputs = NestedWrapped.get_input(step=0, rank=rank)
        NestedWrapped.get_loss(inputs, model(*inputs)).backward()
        all_inputs = all_data(NestedWrapped, 0, world_size, CPU)
        NestedWrapped.get_loss(all_inputs, ref(*all_inputs)).backward()
        assert_match("clip_norm@0", model.clip_grad_norm_(0.01), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01), str(strategy))


def check_hybrid_sync_module_states(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)
    module = torch.nn.Linear(5, 3)
    torch.manual_seed(0)
    expected = torch.nn.Linear(5, 3)
    model = FSDP(module, sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=_pair_groups(), sync_module_states=True)
    with FSDP.summon_full_params(model):
        assert_close(model.module.weight, expected.weight)
        assert_close(model.module.bias, expected.bias)


def check_hybrid_default_groups_from_local_world_size(rank: int, world_size: int) -> None:
    """No process_group: shard within a node of LOCAL_WORLD_SIZE ranks (none of these CPU ranks has a
    GPU), replicate across nodes."""
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "2"}):
        model = FSDP(NestedWrapped(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    assert (model.process_group.size(), model._replicate_group.size()) == (2, 2)
    assert model.rank == rank % 2 and model._replicate_group.rank() == rank // 2
    total = sum(p.numel() for p in NestedWrapped().parameters())
    assert model.module._flat_param.numel() == -(-total // 2)


CHECKS = [
    check_hybrid_shards_within_group,
    check_hybrid_clip_norm,
    check_hybrid_sync_module_states,
    check_hybrid_default_groups_from_local_world_size,
]
rank_checks, test_check = rank_check_tests(CHECKS, world_size=4, timeout_s=400)
