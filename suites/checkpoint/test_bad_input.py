"""Bad checkpoints fail before anything changes, naming the key (or file) and what to do.

Each check trains a model two steps, takes a snapshot of every tensor the model and optimizer hold
(local flat shards, original-parameter views, buffers, optimizer state and hyperparameters),
feeds one kind of bad input, checks the message and that the snapshot is unchanged.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from engine import FSDP, ShardingStrategy, StateDictType
from engine.checkpoint_io import CheckpointError, dcp_load, dcp_save, load, save
from harness.pytest_plugin.rank_checks import rank_check_tests
from suites.checkpoint.training import Setup, train

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _trained(rank: int, orig: bool = False) -> tuple[FSDP, torch.optim.Optimizer]:
    model, optim = Setup(ShardingStrategy.FULL_SHARD, orig, "adamw").build(rank, dist.get_world_size())
    train(model, optim, range(2), rank)
    return model, optim


def _everything(model: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, m in enumerate(FSDP.fsdp_modules(model)):
        if m._unit is not None:
            out[f"flat{i}"] = m._unit.handle.flat_param.detach().clone()
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p.detach().clone()
    for name, b in model.named_buffers():
        out[f"buffer:{name}"] = b.detach().clone()
    out["optim"] = copy.deepcopy(optim.state_dict())
    return out


def _assert_unchanged(before: dict[str, Any], model: FSDP, optim: torch.optim.Optimizer, what: str) -> None:
    after = _everything(model, optim)
    assert set(after) == set(before), f"{what}: the model's tensors changed identity"
    for key in before:
        assert_close(after[key], before[key], rtol=0, atol=0, msg=lambda m, key=key: f"{what} changed {key}: {m}")


def _fails_cleanly(
    model: FSDP, optim: torch.optim.Optimizer, action: Callable[[], Any], error: type[Exception], pattern: str, what: str
) -> None:
    before = _everything(model, optim)
    with pytest.raises(error, match=pattern):
        action()
    _assert_unchanged(before, model, optim, what)


def _load_model(model: FSDP, sd_type: StateDictType, sd: dict[str, Any], strict: bool = True) -> Any:
    with FSDP.state_dict_type(model, sd_type):
        return model.load_state_dict(sd, strict=strict)


def _saved(model: FSDP, optim: torch.optim.Optimizer, sd_type: StateDictType) -> tuple[dict[str, Any], dict[str, Any]]:
    with FSDP.state_dict_type(model, sd_type):
        return model.state_dict(), FSDP.optim_state_dict(model, optim)


def _load_optim(model: FSDP, optim: torch.optim.Optimizer, sd_type: StateDictType, osd: dict[str, Any]) -> None:
    with FSDP.state_dict_type(model, sd_type):
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))


def check_missing_and_unexpected_keys(rank: int, world_size: int) -> None:
    for orig in (False, True):
        model, optim = _trained(rank, orig)
        sd, _ = _saved(model, optim, FULL)
        missing = {k: v for k, v in sd.items() if k != "out.weight"}
        _fails_cleanly(model, optim, lambda: _load_model(model, FULL, missing), RuntimeError,
                       r"missing keys \['out.weight'\].*strict=False", "a missing key")
        extra = dict(sd, **{"head.weight": torch.zeros(2)})
        _fails_cleanly(model, optim, lambda: _load_model(model, FULL, extra), RuntimeError,
                       r"unexpected keys \['head.weight'\]", "an unexpected key")
    # strict=False loads what matches and reports the rest, like nn.Module.
    other, _ = _trained(rank + 100)
    result = _load_model(other, FULL, missing, strict=False)
    assert result.missing_keys == ["out.weight"] and result.unexpected_keys == []


def check_wrong_shape(rank: int, world_size: int) -> None:
    model, optim = _trained(rank)
    sd, _ = _saved(model, optim, FULL)
    bad = dict(sd, **{"inp.weight": torch.zeros(3, 7)})
    _fails_cleanly(model, optim, lambda: _load_model(model, FULL, bad), ValueError,
                   r"size mismatch for inp.weight: .*\(3, 7\).*\(11, 7\)", "a wrong shape")
    bad = dict(sd, **{"norm.running_mean": torch.zeros(5)})
    _fails_cleanly(model, optim, lambda: _load_model(model, FULL, bad), ValueError,
                   r"size mismatch for norm.running_mean", "a wrong buffer shape")


def check_wrong_state_dict_type(rank: int, world_size: int) -> None:
    for orig in (False, True):
        model, optim = _trained(rank, orig)
        full, _ = _saved(model, optim, FULL)
        sharded, _ = _saved(model, optim, SHARDED)
        local, _ = _saved(model, optim, LOCAL)
        _fails_cleanly(model, optim, lambda: _load_model(model, FULL, local), ValueError,
                       r"flat-parameter key '_flat_param', the format of LOCAL_STATE_DICT.*FULL_STATE_DICT",
                       "a local dict under FULL")
        _fails_cleanly(model, optim, lambda: _load_model(model, SHARDED, full), ValueError,
                       r"'inp.weight'\] is a Tensor, not a DTensor.*FULL_STATE_DICT", "a full dict under SHARDED")
        _fails_cleanly(model, optim, lambda: _load_model(model, FULL, sharded), ValueError,
                       r"'inp.weight'\] is a DTensor, the format of SHARDED_STATE_DICT", "a sharded dict under FULL")
        _fails_cleanly(model, optim, lambda: _load_model(model, LOCAL, full), ValueError,
                       r"per-parameter key 'inp.weight'.*LOCAL_STATE_DICT", "a full dict under LOCAL")


def check_bad_optimizer_state(rank: int, world_size: int) -> None:
    for orig in (False, True):
        model, optim = _trained(rank, orig)
        _, osd = _saved(model, optim, FULL)
        unknown = copy.deepcopy(osd)
        unknown["state"]["ghost.weight"] = unknown["state"]["inp.weight"]
        _fails_cleanly(model, optim, lambda: _load_optim(model, optim, FULL, unknown), ValueError,
                       r"optimizer state for unknown parameter 'ghost.weight'", "state for an unknown parameter")
        shape = copy.deepcopy(osd)
        shape["state"]["out.bias"]["exp_avg"] = torch.zeros(4)
        _fails_cleanly(model, optim, lambda: _load_optim(model, optim, FULL, shape), ValueError,
                       r"'exp_avg' of parameter 'out.bias' has shape \(4,\) but the parameter has shape \(3,\)",
                       "a wrong optimizer-state shape")
        own = optim.state_dict()
        _fails_cleanly(model, optim, lambda: _load_optim(model, optim, FULL, own), ValueError,
                       r"parameter id.*FSDP.optim_state_dict", "the optimizer's own state dict")
        groups = copy.deepcopy(osd)
        groups["param_groups"][0]["params"] = groups["param_groups"][0]["params"][1:]
        _fails_cleanly(model, optim, lambda: _load_optim(model, optim, FULL, groups), ValueError,
                       r"param group 0: .*differ in \['inp.weight'\]", "a param group of other parameters")
        _fails_cleanly(model, optim, lambda: _load_optim(model, optim, SHARDED, osd), ValueError,
                       r"plain tensor \(FULL_STATE_DICT\) but the active type is SHARDED_STATE_DICT",
                       "full optimizer state under SHARDED")
        _fails_cleanly(model, optim, lambda: _load_optim(model, optim, FULL, {"state": {}}), ValueError,
                       r"'state' and 'param_groups'", "a dict without param groups")


def _shared_dir() -> str:
    holder = [tempfile.mkdtemp(prefix="ckpt-bad-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def check_truncated_and_corrupt_files(rank: int, world_size: int) -> None:
    model, optim = _trained(rank)
    sd, osd = _saved(model, optim, FULL)
    path = os.path.join(_shared_dir(), f"rank{rank}.pt")
    save({"model": sd, "optim": osd}, path)
    assert load(path)["model"].keys() == sd.keys()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    _fails_cleanly(model, optim, lambda: _load_model(model, FULL, load(path)["model"]), CheckpointError,
                   rf"cannot read checkpoint {re.escape(path)} \({size // 2} bytes\).*truncated.*save it again",
                   "a truncated file")
    with open(path, "wb") as f:
        f.write(b"not a checkpoint" * 10)
    _fails_cleanly(model, optim, lambda: load(path), CheckpointError, rf"cannot read checkpoint {re.escape(path)}",
                   "a corrupt file")
    missing = path + ".missing"
    _fails_cleanly(model, optim, lambda: load(missing), CheckpointError, rf"checkpoint {re.escape(missing)} does not exist",
                   "a missing file")


def check_truncated_distributed_checkpoint(rank: int, world_size: int) -> None:
    model, optim = _trained(rank, orig=True)
    path = os.path.join(_shared_dir(), "dcp")
    with FSDP.state_dict_type(model, SHARDED):
        dcp_save({"model": model.state_dict()}, path)
    dist.barrier()
    if rank == 0:
        for name in os.listdir(path):
            if name.endswith(".distcp"):
                with open(os.path.join(path, name), "r+b") as f:
                    f.truncate(10)
    dist.barrier()

    def resume() -> None:
        with FSDP.state_dict_type(model, SHARDED):
            template = {"model": model.state_dict()}
            dcp_load(template, path)
            model.load_state_dict(template["model"])

    _fails_cleanly(model, optim, resume, CheckpointError,
                   rf"cannot read distributed checkpoint {re.escape(path)}: rank 0: RuntimeError: .*save it again", "a truncated DCP checkpoint")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.dirname(path))


CHECKS = [
    check_missing_and_unexpected_keys,
    check_wrong_shape,
    check_wrong_state_dict_type,
    check_bad_optimizer_state,
    check_truncated_and_corrupt_files,
    check_truncated_distributed_checkpoint,
]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2)
