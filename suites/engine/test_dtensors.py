"""``engine.dtensors`` and the harness's own copy, ``harness.engines.dtensors`` (the reference side never imports
the engine): DTensors gathered and split with plain collectives, against DTensor's own
``full_tensor``/``distribute_tensor`` on CPU ranks, and on ranks on the GPUs (sharing one where there
are fewer GPUs than ranks, where DTensor's own functional collectives crash). Every check runs on both
copies."""

from __future__ import annotations

import contextlib
import itertools
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing import assert_close

import engine.collectives
import engine.dtensors
import harness.engines.dtensors
from engine.materialize import sync_states
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.ranks.rank import rank_device
from suites.engine.refusing_groups import groups_refusing_cpu


#: the two copies: the engine's, and the harness's own for the reference side.
COPIES = (engine.dtensors, harness.engines.dtensors)


@pytest.mark.parametrize("copy", COPIES, ids=lambda m: m.__name__)
def test_chunk_rows_follow_torch_chunk(copy: ModuleType) -> None:
    chunk_rows = copy.chunk_rows
    for size in range(0, 12):
        for n in range(1, 6):
            pieces = torch.arange(size).chunk(n) if size else ()
            got = [chunk_rows(size, n, i) for i in range(n)]
            starts = [int(p[0]) for p in pieces]
            assert [g for g in got if g[1]] == [(s, len(p)) for s, p in zip(starts, pieces)], (size, n, got)
            assert sum(g[1] for g in got) == size


def _values(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32, device=device).reshape(shape) + 1


def check_uneven_shards_round_trip(rank: int, world_size: int) -> None:
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    for copy in COPIES:
        _uneven_shards_round_trip(copy, mesh, device)


def _uneven_shards_round_trip(copy: ModuleType, mesh: DeviceMesh, device: torch.device) -> None:
    distribute, full_tensor, local_chunk = copy.distribute, copy.full_tensor, copy.local_chunk
    # 3 rows on 2 ranks (uneven), 1 row (a rank with nothing), 0 rows, and dim 1.
    for shape, placement in [((3, 4), Shard(0)), ((1, 5), Shard(0)), ((0, 3), Shard(0)), ((2, 5), Shard(1)),
                             ((4,), Replicate())]:
        full = _values(shape, device)
        dt = distribute(full, mesh, [placement])
        assert isinstance(dt, DTensor) and tuple(dt.shape) == shape
        assert_close(dt.to_local(), local_chunk(full, mesh, [placement]), rtol=0, atol=0)
        assert_close(full_tensor(dt), full, rtol=0, atol=0)
    for dtype in (torch.bfloat16, torch.float16):
        full = _values((5, 3), device).to(dtype)
        assert_close(full_tensor(distribute(full, mesh, [Shard(0)])), full, rtol=0, atol=0)


def check_matches_dtensor_on_cpu(rank: int, world_size: int) -> None:
    """Where DTensor's own collectives run (CPU ranks), both agree element for element."""
    if rank_device().type != "cpu":
        return  # its functional collectives are what this module replaces on shared GPUs
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _values((7, 3), torch.device("cpu"))
    theirs = distribute_tensor(full, mesh, [Shard(0)])
    for copy in COPIES:
        ours = copy.distribute(full, mesh, [Shard(0)])
        assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0)
        assert_close(copy.full_tensor(theirs), theirs.full_tensor(), rtol=0, atol=0)


def check_two_dimensional_mesh(rank: int, world_size: int) -> None:
    """(replicate, shard) as HSDP lays parameters out, and shard on both mesh dimensions."""
    if world_size % 2:
        return
    device = rank_device()
    mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    for copy, placements in itertools.product(COPIES, ([Replicate(), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Shard(0)])):
        full = _values((5, 6), device)
        dt = copy.distribute(full, mesh, placements)
        assert_close(copy.full_tensor(dt), full, rtol=0, atol=0, msg=lambda m: f"{copy.__name__} {placements}: {m}")
    dist.barrier()


def check_cpu_values_travel_through_the_accelerator(rank: int, world_size: int) -> None:
    """Optimizer state loaded to the CPU (a CPU DTensor on the ranks' mesh) and CPU module states under
    ``sync_module_states`` reach a group whose backend refuses CPU tensors (NCCL) through its
    accelerator: on CPU ranks the refusal is emulated (``groups_refusing_cpu``), on GPUs it is real
    wherever the ranks hold a GPU each."""
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    full = _values((5, 3), device)
    on_cpu = [(copy, copy.distribute(full, mesh, [Shard(0)]).cpu()) for copy in COPIES]
    states = [torch.full((3,), float(rank)), torch.full((2,), float(rank) + 1)]
    refusal = groups_refusing_cpu() if device.type == "cpu" else contextlib.nullcontext([])
    with refusal as staged:
        gathered = []
        for copy, value in on_cpu:
            before = len(staged)
            gathered.append(copy.full_tensor(value))
            assert device.type != "cpu" or len(staged) > before, f"{copy.__name__}: its gather was not staged"
        sync_states(states, [mesh.get_group(0)])
    for got in gathered:
        assert got.device.type == "cpu"
        assert_close(got, full.cpu(), rtol=0, atol=0)
    assert_close(states, [torch.zeros(3), torch.ones(2)], rtol=0, atol=0)
    if device.type == "cpu":
        assert staged, "nothing was staged: the check did not reach the collectives it guards"


@pytest.mark.parametrize("rule", [engine.collectives, harness.engines.dtensors], ids=lambda m: m.__name__)
def test_the_staging_rule_is_the_same_in_both_copies(rule: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a backend takes, and where a CPU tensor goes on a group that refuses it: the engine's rule
    (``engine.collectives``) and the harness's copy alike ([Note: CPU tensors on accelerator groups])."""
    assert rule.device_types_of("nccl") == {"cuda"} and rule.device_types_of("gloo") == {"cpu", "cuda"}
    assert rule.device_types_of("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert rule.device_types_of("no-such-backend") == {"cpu", "cuda"}
    cpu = torch.ones(2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert rule.staged(cpu, object()) is cpu, "a group that takes CPU tensors gets the tensor itself"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    bound = type("Group", (), {"bound_device_id": torch.device("cuda", 1)})()
    assert rule.comm_device(bound, cpu.device) == torch.device("cuda", 1), "the group's bound device first"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no such device to stage them on"):
        rule.staged(cpu, object())


def test_groups_refusing_cpu_refuse_what_nccl_refuses() -> None:
    """The emulation itself refuses a CPU tensor that skipped staging (no process group needed to raise)."""
    with groups_refusing_cpu():
        with pytest.raises(RuntimeError, match="device type cpu"):
            dist.all_reduce(torch.ones(1))


CHECKS = [check_uneven_shards_round_trip, check_matches_dtensor_on_cpu, check_two_dimensional_mesh,
          check_cpu_values_travel_through_the_accelerator]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2, device=("cpu", "cuda"), timeout_s=120)
