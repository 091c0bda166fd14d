"""Communication hooks against torch FSDP1: the same training with torch's hooks on torch FSDP1 and
with ours on the engine gives the same losses and parameters; registration rules as torch's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from engine import FSDP, ShardingStrategy, StateDictType, comm_hooks
from harness.pytest_plugin.rank_checks import RankChecks, rank_checks_fixture, rank_check_tests
from harness.pytest_plugin import needs_gpus
from suites.checkpoint.training import CkptNet, device_for, full_state, hybrid_groups, make_optimizer, train, wrapped


def _theirs(strategy_name: str, device: torch.device) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    kwargs = {"device_id": device, "sharding_strategy": TorchStrategy[strategy_name]}
    model = CkptNet(device)
    model.block[0] = TorchFSDP(model.block[0], **kwargs)
    model.block[2] = TorchFSDP(model.block[2], **kwargs)
    model.out = TorchFSDP(model.out, **kwargs)
    return TorchFSDP(model, **kwargs), TorchFSDP


def _torch_hooks() -> Any:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    return default_hooks


def _torch_compress_on_cpu(prec: torch.dtype) -> Any:
    """torch's compression hook, from torch's own default hooks: its ``_decompress`` calls
    ``record_stream`` on the CPU stream, which torch does not support, so on CPU the cast back to
    ``parameter_type`` is done here; everything else is torch's."""
    hooks = _torch_hooks()

    def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        grad.data = grad.data.to(prec)
        if output is not None:
            output.data = output.data.to(prec)
            hooks.reduce_scatter_hook(state, grad, output)
            output.data = output.data.to(state.parameter_type)
        else:
            hooks.allreduce_hook(state, grad)
            grad.data = grad.data.to(state.parameter_type)

    # Named like torch's hook, so torch FSDP1 skips its reduce-dtype cast for it the same way.
    hook.__name__ = f"{'fp16' if prec == torch.float16 else 'bf16'}_compress_hook"
    return hook


def _full_params_torch(model: torch.nn.Module, torch_fsdp: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import StateDictType as TorchType

    with torch_fsdp.state_dict_type(model, TorchType.FULL_STATE_DICT):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(hook_name: str, strategy: ShardingStrategy, low_precision: bool, rank: int) -> None:
    device = device_for(rank)
    ours = wrapped(device, sharding_strategy=strategy, **({"device_id": device} if device.type == "cuda" else {}))
    theirs, torch_fsdp = _theirs(strategy.name, device)
    group = dist.group.WORLD
    if low_precision:
        ours.register_comm_hook(comm_hooks.LowPrecisionState(group), getattr(comm_hooks, hook_name))
        prec = torch.float16 if hook_name.startswith("fp16") else torch.bfloat16
        their_hook = getattr(_torch_hooks(), hook_name) if device.type == "cuda" else _torch_compress_on_cpu(prec)
        theirs.register_comm_hook(_torch_hooks().LowPrecisionState(group), their_hook)
    else:
        ours.register_comm_hook(comm_hooks.DefaultState(group), getattr(comm_hooks, hook_name))
        theirs.register_comm_hook(_torch_hooks().DefaultState(group), getattr(_torch_hooks(), hook_name))
    our_losses = train(ours, make_optimizer("sgd", ours.parameters()), range(3), rank)
    their_losses = train(theirs, make_optimizer("sgd", theirs.parameters()), range(3), rank)
    context = f"{hook_name} with {strategy.name}"
    # Bitwise on CPU; CUDA kernels may pick other reduction orders for the two models.
    tol: dict[str, float] = {"rtol": 0.0, "atol": 0.0} if device.type == "cpu" else {}
    assert_close(torch.tensor(our_losses), torch.tensor(their_losses), **tol, msg=lambda m: f"{context}: {m}")
    want = _full_params_torch(theirs, torch_fsdp)
    for key, value in full_state(ours).items():
        assert_close(value.cpu(), want[key].cpu(), **tol, msg=lambda m, key=key: f"{context}: {key}: {m}")


def check_default_hooks_match_torch(rank: int, world_size: int) -> None:
    _compare("reduce_scatter_hook", ShardingStrategy.FULL_SHARD, False, rank)
    _compare("reduce_scatter_hook", ShardingStrategy.SHARD_GRAD_OP, False, rank)
    _compare("allreduce_hook", ShardingStrategy.NO_SHARD, False, rank)


def check_compression_hooks_match_torch(rank: int, world_size: int) -> None:
    _compare("fp16_compress_hook", ShardingStrategy.FULL_SHARD, True, rank)
    _compare("bf16_compress_hook", ShardingStrategy.FULL_SHARD, True, rank)
    _compare("fp16_compress_hook", ShardingStrategy.NO_SHARD, True, rank)


def check_hook_replaces_reduction(rank: int, world_size: int) -> None:
    """A hook that does not communicate leaves every rank with its own gradient."""
    calls: list[tuple[int, int]] = []

    def local_only(state: Any, grad: torch.Tensor, output: torch.Tensor) -> None:
        calls.append((grad.numel(), output.numel()))
        output.copy_(grad.chunk(world_size)[rank])

    model = wrapped()
    model.register_comm_hook(None, local_only)
    units = [m for m in FSDP.fsdp_modules(model) if m._unit is not None]
    train(model, make_optimizer("sgd", model.parameters()), range(1), rank)
    assert len(calls) == len(units), f"hook ran {len(calls)} times for {len(units)} units"
    assert all(g == o * world_size for g, o in calls), calls
    default = wrapped()
    train(default, make_optimizer("sgd", default.parameters()), range(1), rank)
    hooked, averaged = full_state(model), full_state(default)
    # Each rank stepped its shard with its own, unaveraged gradient.
    assert not torch.equal(hooked["out.weight"], averaged["out.weight"]), "gradients were averaged despite the hook"


def check_registration_rules(rank: int, world_size: int) -> None:
    model = wrapped()
    # As in torch FSDP1, a nested unit asked before its root initializes is a root of its own.
    assert model.check_is_root()
    with pytest.raises(AssertionError, match="register_comm_hook can only be called on a root instance"):
        model.out.register_comm_hook(None, comm_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match="must be callable"):
        model.register_comm_hook(None, "reduce_scatter_hook")
    model.register_comm_hook(comm_hooks.DefaultState(dist.group.WORLD), comm_hooks.reduce_scatter_hook)
    with pytest.raises(AssertionError, match="A communication hook is already registered"):
        model.register_comm_hook(comm_hooks.DefaultState(dist.group.WORLD), comm_hooks.reduce_scatter_hook)
    hybrid = wrapped(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=hybrid_groups(world_size))
    with pytest.raises(AssertionError, match="not supported for hybrid strategies"):
        hybrid.register_comm_hook(None, comm_hooks.reduce_scatter_hook)
    trained = wrapped()
    train(trained, make_optimizer("sgd", trained.parameters()), range(1), rank)
    with pytest.raises(AssertionError, match="before the first forward"):
        trained.register_comm_hook(None, comm_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match="explicit ProcessGroup"):
        comm_hooks.DefaultState(None)
    state = comm_hooks.DefaultState(dist.group.WORLD)
    want = _torch_hooks().DefaultState(dist.group.WORLD)
    assert (state.gradient_predivide_factor, state.gradient_postdivide_factor) == (
        want.gradient_predivide_factor,
        want.gradient_postdivide_factor,
    )
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        assert "out.weight" in model.state_dict()


CHECKS = [
    check_default_hooks_match_torch,
    check_compression_hooks_match_torch,
    check_hook_replaces_reduction,
    check_registration_rules,
]

rank_checks, test_check = rank_check_tests(CHECKS, world_size=2)

GPU_CHECKS = [check_default_hooks_match_torch, check_compression_hooks_match_torch]


gpu_checks = rank_checks_fixture(GPU_CHECKS, world_size=2, device="cuda", timeout_s=600)


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("check", GPU_CHECKS, ids=lambda c: c.__name__)
def test_against_torch_on_2_gpus(gpu_checks: RankChecks, check: Any) -> None:
    """With NCCL torch's own compression hooks run unchanged (their ``record_stream`` needs CUDA)."""
    gpu_checks.assert_passed(check)
