"""``engine.dtensors``: DTensors gathered and split with plain collectives, against DTensor's own
``full_tensor``/``distribute_tensor`` on CPU ranks, and on ranks on the GPUs (sharing one where there
are fewer GPUs than ranks, where DTensor's own functional collectives crash)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing import assert_close

from engine.dtensors import chunk_rows, distribute, full_tensor, local_chunk
from engine.materialize import sync_states
from harness.conformance.rank_sessions import session_tests
from harness.rank import rank_device
from suites.engine.refusing_groups import groups_refusing_cpu


def test_chunk_rows_follow_torch_chunk() -> None:
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
    ours = distribute(full, mesh, [Shard(0)])
    assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0)
    assert_close(full_tensor(theirs), theirs.full_tensor(), rtol=0, atol=0)


def check_two_dimensional_mesh(rank: int, world_size: int) -> None:
    """(replicate, shard) as HSDP lays parameters out, and shard on both mesh dimensions."""
    if world_size % 2:
        return
    device = rank_device()
    mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    for placements in ([Replicate(), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Shard(0)]):
        full = _values((5, 6), device)
        dt = distribute(full, mesh, placements)
        assert_close(full_tensor(dt), full, rtol=0, atol=0, msg=lambda m: f"{placements}: {m}")
    dist.barrier()


def check_cpu_values_travel_through_the_accelerator(rank: int, world_size: int) -> None:
    """Optimizer state loaded to the CPU (a CPU DTensor on the ranks' mesh) and CPU module states under
    ``sync_module_states`` reach a group whose backend refuses CPU tensors (NCCL) through its
    accelerator: on CPU ranks the refusal is emulated (``groups_refusing_cpu``), on GPUs it is real
    wherever the ranks hold a GPU each."""
    device = rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    full = _values((5, 3), device)
    on_cpu = distribute(full, mesh, [Shard(0)]).cpu()
    states = [torch.full((3,), float(rank)), torch.full((2,), float(rank) + 1)]
    refusal = groups_refusing_cpu() if device.type == "cpu" else contextlib.nullcontext([])
    with refusal as staged:
        gathered = full_tensor(on_cpu)
        sync_states(states, [mesh.get_group(0)])
    assert gathered.device.type == "cpu"
    assert_close(gathered, full.cpu(), rtol=0, atol=0)
    assert_close(states, [torch.zeros(3), torch.ones(2)], rtol=0, atol=0)
    if device.type == "cpu":
        assert staged, "nothing was staged: the check did not reach the collectives it guards"


def test_groups_refusing_cpu_refuse_what_nccl_refuses() -> None:
    """The emulation itself refuses a CPU tensor that skipped staging (no process group needed to raise)."""
    with groups_refusing_cpu():
        with pytest.raises(RuntimeError, match="device type cpu"):
            dist.all_reduce(torch.ones(1))


CHECKS = [check_uneven_shards_round_trip, check_matches_dtensor_on_cpu, check_two_dimensional_mesh,
          check_cpu_values_travel_through_the_accelerator]

session, test_check = session_tests(CHECKS, world_size=2, device=("cpu", "cuda"), timeout_s=120)
