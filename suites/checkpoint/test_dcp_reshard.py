"""A sharded checkpoint saved with ``torch.distributed.checkpoint`` on 2 ranks, loaded on 4 ranks
(another strategy and ``use_orig_params``) and on 1 process as a plain ``nn.Module`` with no process
group: the same parameters everywhere, and on 4 ranks the same optimizer state."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.testing import assert_close

from engine import FSDP, ShardingStrategy, StateDictType
from engine.checkpoint_io import dcp_load, dcp_save
from harness.pytest_plugin.rank_checks import RankChecks, run_checks
from harness.pytest_plugin.xdist_groups import one_worker
from suites.checkpoint.training import CkptNet, Setup, full_state, train


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Batch-norm statistics are per rank; the checkpoint holds one rank's copy.
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


def check_save_on_2(path: str, rank: int, world_size: int) -> None:
    model, optim = Setup(ShardingStrategy.FULL_SHARD, False, "adamw").build(rank, world_size)
    train(model, optim, range(3), rank)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp_save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, os.path.join(path, "dcp"))
    expected = full_state(model)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        expected_optim = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        torch.save(expected, os.path.join(path, "expected.pt"))
        torch.save(expected_optim, os.path.join(path, "expected_optim.pt"))


def check_resume_on_4(path: str, rank: int, world_size: int) -> None:
    model, optim = Setup(ShardingStrategy.SHARD_GRAD_OP, True, "adamw").build(rank, world_size)
    # One step gives the fresh optimizer state of every shape: the template DCP loads into.
    train(model, optim, range(1), rank)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp_load(template, os.path.join(path, "dcp"))
        model.load_state_dict(template["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, template["optim"]))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        optim_state = FSDP.optim_state_dict(model, optim)
    want_optim = torch.load(os.path.join(path, "expected_optim.pt"))
    assert list(optim_state["state"]) == list(want_optim["state"])
    for fqn, st in want_optim["state"].items():
        for name, value in st.items():
            assert_close(optim_state["state"][fqn][name], value, rtol=0, atol=0, msg=lambda m: f"{fqn}.{name} at 4 ranks: {m}")
    want = _params(torch.load(os.path.join(path, "expected.pt")))
    got = full_state(model)
    for key, value in want.items():
        assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key} at 4 ranks: {m}")
    train(model, optim, range(3, 4), rank)  # and it trains on


@pytest.fixture(scope="module")
@one_worker
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("dcp-reshard"))
    outcome = run_checks([check_save_on_2], world_size=2, args=(path,))
    RankChecks(outcome).assert_passed(check_save_on_2)
    return path


def test_resume_on_4_ranks(checkpoint_dir: str) -> None:
    RankChecks(run_checks([check_resume_on_4], world_size=4, args=(checkpoint_dir,))).assert_passed(check_resume_on_4)


def test_load_unsharded_without_process_group(checkpoint_dir: str) -> None:
    assert not dist.is_initialized()
    plain = CkptNet()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint_dir, "dcp"))
    plain.load_state_dict(state["model"])
    want = _params(torch.load(os.path.join(checkpoint_dir, "expected.pt")))
    got = plain.state_dict()
    for key, value in want.items():
        assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key} unsharded: {m}")
