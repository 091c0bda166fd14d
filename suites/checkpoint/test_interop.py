"""State-dict formats and settings against torch: plain modules, torch FSDP1, torch FSDP2 (via DCP).

- a FULL state dict of ours loads into the plain model and into torch FSDP1, and torch FSDP1's into
  ours; the same for full optimizer state (FSDP1 and ours key it by clean FQN);
- ``rank0_only``, ``offload_to_cpu``, mixed precision (full-precision values) and buffers;
- ``set_state_dict_type`` returns the previous settings; torch's own config objects are accepted;
- sharded state of ours goes through ``torch.distributed.checkpoint`` into torch FSDP2 and back.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from engine import (
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from engine.dtensors import full_tensor
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.ranks.rank import rank_device
from suites.checkpoint.training import CkptNet, Setup, full_state, make_optimizer, train, wrapped


def _torch_fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    model.block[0] = TorchFSDP(model.block[0], device_id=rank_device())
    model.block[2] = TorchFSDP(model.block[2], device_id=rank_device())
    model.out = TorchFSDP(model.out, device_id=rank_device())
    return TorchFSDP(model, device_id=rank_device())


def _train_ours(rank: int, orig: bool = False, steps: int = 2) -> tuple[FSDP, torch.optim.Optimizer]:
    model, optim = Setup(ShardingStrategy.FULL_SHARD, orig, "adamw").build(rank, dist.get_world_size())
    train(model, optim, range(steps), rank)
    return model, optim


def check_full_into_plain_model(rank: int, world_size: int) -> None:
    model, _ = _train_ours(rank)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank != 0:
        assert sd == {}, f"rank0_only: rank {rank} got keys {sorted(sd)}"
        return
    plain = CkptNet()
    plain.load_state_dict(sd)  # strict: every key of the plain model, no other
    assert all(v.device.type == "cpu" for v in sd.values())
    assert "norm.running_mean" in sd and "norm.num_batches_tracked" in sd
    for key, value in plain.state_dict().items():
        assert_close(value, sd[key], rtol=0, atol=0, check_device=False)


def check_full_ours_into_torch_fsdp1_and_back(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchType

    ours, optim = _train_ours(rank)
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
        sd = ours.state_dict()
        osd = FSDP.optim_state_dict(ours, optim)
    theirs = _torch_fsdp1(CkptNet())
    their_optim = make_optimizer("adamw", theirs.parameters())
    with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT):
        theirs.load_state_dict(sd)
        their_optim.load_state_dict(TorchFSDP.optim_state_dict_to_load(theirs, their_optim, osd))
        assert set(theirs.state_dict()) == set(sd)
    # One more step on each must agree: parameters and optimizer state both arrived.
    train(ours, optim, range(2, 3), rank)
    train(theirs, their_optim, range(2, 3), rank)
    with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT):
        their_sd = theirs.state_dict()
        their_osd = TorchFSDP.optim_state_dict(theirs, their_optim)
    mine = full_state(ours)
    for key, value in mine.items():
        assert_close(their_sd[key].cpu(), value, msg=lambda m, key=key: f"after a step, {key}: {m}")
    # And torch FSDP1's state (model and optimizer) loads into a fresh engine model.
    fresh, fresh_optim = Setup(ShardingStrategy.FULL_SHARD, False, "adamw").build(rank, world_size)
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
        fresh.load_state_dict(their_sd)
        fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, their_osd))
        again = FSDP.optim_state_dict(fresh, fresh_optim)
    for key, value in full_state(fresh).items():
        assert_close(value, their_sd[key].cpu(), rtol=0, atol=0)
    assert list(again["state"]) == list(their_osd["state"]), (list(again["state"]), list(their_osd["state"]))
    for fqn, st in their_osd["state"].items():
        for name, value in st.items():
            assert_close(again["state"][fqn][name], value, rtol=0, atol=0, check_device=False, msg=lambda m: f"{fqn}.{name}: {m}")
    assert again["param_groups"][0]["params"] == their_osd["param_groups"][0]["params"]


def check_mixed_precision_saves_full_precision(rank: int, world_size: int) -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    for orig in (False, True):
        model = wrapped(use_orig_params=orig, mixed_precision=mp)
        optim = make_optimizer("adamw", model.parameters())
        train(model, optim, range(2), rank)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            sd = model.state_dict()
        with FSDP.summon_full_params(model):
            summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
        for key, value in summoned.items():
            assert sd[key].dtype == torch.float32, f"{key} saved as {sd[key].dtype}"
            assert_close(sd[key], value, rtol=0, atol=0, check_device=False)
        assert sd["norm.running_mean"].dtype == torch.float32
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            ssd = model.state_dict()
        for key in summoned:
            assert isinstance(ssd[key], DTensor) and ssd[key].dtype == torch.float32
            assert_close(full_tensor(ssd[key]), sd[key], rtol=0, atol=0)


def check_settings_like_torch(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import FullStateDictConfig as TorchFull
    from torch.distributed.fsdp import StateDictType as TorchType

    model = wrapped()
    prev = FSDP.set_state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True), ShardedOptimStateDictConfig()
    )
    assert prev.state_dict_type == StateDictType.FULL_STATE_DICT
    assert prev.state_dict_config == FullStateDictConfig() and prev.optim_state_dict_config == FullOptimStateDictConfig()
    now = FSDP.get_state_dict_type(model)
    assert now.state_dict_type == StateDictType.SHARDED_STATE_DICT and now.state_dict_config.offload_to_cpu
    assert all(m._state_dict_type == StateDictType.SHARDED_STATE_DICT for m in FSDP.fsdp_modules(model))
    with pytest.raises(RuntimeError, match="Expected state_dict_config of type FullStateDictConfig"):
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, ShardedStateDictConfig())
    try:
        with FSDP.state_dict_type(model, TorchType.FULL_STATE_DICT, TorchFull(rank0_only=True)):
            inside = FSDP.get_state_dict_type(model)
            assert inside.state_dict_type == StateDictType.FULL_STATE_DICT and inside.state_dict_config.rank0_only
            raise KeyError("leaving by an exception")
    except KeyError:
        pass
    assert FSDP.get_state_dict_type(model) == now, "state_dict_type() did not restore the settings"


def check_is_root(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    ours = wrapped()
    theirs = _torch_fsdp1(CkptNet())
    assert ours.check_is_root() is True and ours.out.check_is_root() is False
    assert theirs.check_is_root() is True and theirs.out.check_is_root() is False
    nested_first = wrapped()
    # A nested unit asked first is a root until its parent initializes (torch FSDP1 alike).
    assert nested_first.out.check_is_root() == TorchFSDP.check_is_root(_torch_fsdp1(CkptNet()).out)


def _dcp_dir() -> str:
    """One directory name for every rank (rank 0 creates it and broadcasts the name)."""
    holder = [tempfile.mkdtemp(prefix="ckpt-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _fsdp2_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = CkptNet()
    for unit in (model.block[0], model.block[2], model.out):
        fully_shard(unit)
    fully_shard(model)
    return model


def _fsdp2_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v).detach().cpu().clone() for k, v in model.state_dict().items()}


def _params_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Batch-norm statistics differ per rank (every rank normalizes its own batch) and a checkpoint
    holds one copy of a plain tensor, from whichever rank DCP picks: parameters are compared."""
    assert "norm.running_mean" in state, sorted(state)
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


def check_dcp_with_torch_fsdp2_both_ways(rank: int, world_size: int) -> None:
    ours, _ = _train_ours(rank, orig=True)
    path = _dcp_dir()
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
        dcp.save(ours.state_dict(), checkpoint_id=os.path.join(path, "ours"))
    theirs = _fsdp2_model()
    template = theirs.state_dict()
    dcp.load(template, checkpoint_id=os.path.join(path, "ours"))
    theirs.load_state_dict(template)
    want = _params_only(full_state(ours))
    got = _fsdp2_full(theirs)
    for key, value in want.items():
        assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"ours -> FSDP2, {key}: {m}")
    # FSDP2 trains on, saves; a fresh engine model loads it.
    train(theirs, make_optimizer("sgd", theirs.parameters()), range(2), rank)
    dcp.save(theirs.state_dict(), checkpoint_id=os.path.join(path, "theirs"))
    fresh, _ = Setup(ShardingStrategy.SHARD_GRAD_OP, False, "sgd").build(rank, world_size)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        template = fresh.state_dict()
        dcp.load(template, checkpoint_id=os.path.join(path, "theirs"))
        fresh.load_state_dict(template)
    want = _fsdp2_full(theirs)
    for key, value in _params_only(full_state(fresh)).items():
        assert_close(value, want[key], rtol=0, atol=0, msg=lambda m, key=key: f"FSDP2 -> ours, {key}: {m}")


def _assert_optim_equal(got: dict, want: dict, context: str) -> None:
    assert list(got["state"]) == list(want["state"]), f"{context}: {list(got['state'])} vs {list(want['state'])}"
    for key, st in want["state"].items():
        assert set(got["state"][key]) == set(st), f"{context}: {key}: {list(got['state'][key])} vs {list(st)}"
        for name, value in st.items():
            other = got["state"][key][name]
            if isinstance(other, DTensor):
                other = full_tensor(other)
            # Bitwise where the ranks compute on the CPU; on CUDA the two engines' kernels for the same math
            # (cuBLAS picks by shape and layout) round differently in the last float32 bits: a few ulps
            # (seen: 3.8e-6 relative on one H100).
            tol = {"rtol": 0, "atol": 0} if rank_device().type == "cpu" else {"rtol": 1e-5, "atol": 1e-9}
            assert_close(other, value, check_device=False, msg=lambda m: f"{context}: {key}.{name}: {m}", **tol)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]


def check_older_optimizer_helpers(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from engine import OptimStateKeyType

    ours, optim = _train_ours(rank)
    theirs = _torch_fsdp1(CkptNet())
    their_optim = make_optimizer("adamw", theirs.parameters())
    train(theirs, their_optim, range(2), rank)
    full = FSDP.full_optim_state_dict(ours, optim)
    their_full = TorchFSDP.full_optim_state_dict(theirs, their_optim)
    if rank == 0:
        _assert_optim_equal(full, their_full, "full_optim_state_dict vs torch FSDP1")
    else:
        assert full == {} and their_full == {}
    everywhere = FSDP.full_optim_state_dict(ours, optim, rank0_only=False)
    _assert_optim_equal(FSDP.sharded_optim_state_dict(ours, optim), everywhere, "sharded_optim_state_dict")
    own = optim.state_dict()
    for name, to_load in {
        "scatter_full_optim_state_dict": lambda m, o: FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, m, optim=o),
        "shard_full_optim_state_dict": lambda m, o: FSDP.shard_full_optim_state_dict(everywhere, m, optim=o),
        "flatten_sharded_optim_state_dict": lambda m, o: FSDP.flatten_sharded_optim_state_dict(
            FSDP.sharded_optim_state_dict(ours, optim), m, o
        ),
    }.items():
        fresh, fresh_optim = Setup(ShardingStrategy.FULL_SHARD, False, "adamw").build(rank, world_size)
        fresh_optim.load_state_dict(to_load(fresh, fresh_optim))
        loaded = fresh_optim.state_dict()
        for key, st in own["state"].items():
            for k, value in st.items():
                assert_close(loaded["state"][key][k], value, rtol=0, atol=0, check_device=False, msg=lambda m: f"{name}: {key}.{k}: {m}")
    # Re-keying: a full state by name loads into the unwrapped model's optimizer by position.
    plain = CkptNet()
    plain_optim = make_optimizer("adamw", plain.parameters())
    by_id = FSDP.rekey_optim_state_dict(everywhere, OptimStateKeyType.PARAM_ID, plain, optim=plain_optim)
    assert list(by_id["state"]) == list(range(len(everywhere["state"])))
    plain_optim.load_state_dict(by_id)
    back = FSDP.rekey_optim_state_dict(plain_optim.state_dict(), OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim)
    _assert_optim_equal(back, everywhere, "rekey_optim_state_dict round trip")


CHECKS = [
    check_full_into_plain_model,
    check_full_ours_into_torch_fsdp1_and_back,
    check_mixed_precision_saves_full_precision,
    check_settings_like_torch,
    check_is_root,
    check_dcp_with_torch_fsdp2_both_ways,
    check_older_optimizer_helpers,
]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2, device=("cpu", "cuda"))
