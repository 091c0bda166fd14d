"""Construction: auto-wrap policies, meta-device and param_init_fn initialization,
sync_module_states, ignored modules, the flat parameter as the only registered parameter; on
2 CPU ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from engine import FSDP, FlatParameter, ShardingStrategy
from engine.wrap import ModuleWrapPolicy, always_wrap_policy
from harness.cases.case import CaseConfig
from harness.cases.model_protocol import wrap_bottom_up
from harness.conformance.engine_models import NESTED, NestedWrapped
from harness.conformance.fsdp1_checks import assert_trains_like_local_reference, load_api
from harness.pytest_plugin.rank_checks import rank_check_tests

CPU = torch.device("cpu")


def _units(model: nn.Module) -> list[str]:
    return [type(m.module).__name__ for m in FSDP.fsdp_modules(model)]


#: How the auto-wrapped models train: as the harness's case of the same model (its optimizer and steps), so
#: the harness's local reference says what their parameters must be.
AUTO_WRAPPED_CASE = CaseConfig(engine="builtin", reference="local", model=NESTED, steps=3)


def _parity_with_plain(model: nn.Module) -> None:
    """Train the auto-wrapped model (units the harness cannot build: it wraps declared units) the case's
    way and compare with the harness's local reference."""
    assert_trains_like_local_reference(load_api("builtin"), model, model.module, AUTO_WRAPPED_CASE, CPU, "auto-wrapped")


def check_module_wrap_policy(rank: int, world_size: int) -> None:
    for orig in (False, True):
        model = FSDP(NestedWrapped(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=orig)
        assert _units(model) == ["NestedWrapped", "Linear", "Linear", "Linear", "Linear"], _units(model)
        _parity_with_plain(model)


def check_callable_policies(rank: int, world_size: int) -> None:
    def big_linears(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or (isinstance(module, nn.Linear) and nonwrapped_numel >= 150)

    model = FSDP(NestedWrapped(), auto_wrap_policy=big_linears, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    # inp 8x12+12=108 and out 12x5+5=65 stay in the root; block's two linears (208, 204) are units.
    assert _units(model) == ["NestedWrapped", "Linear", "Linear"], _units(model)
    _parity_with_plain(model)
    model = FSDP(NestedWrapped(), auto_wrap_policy=always_wrap_policy)
    assert len(FSDP.fsdp_modules(model)) == 7, _units(model)
    _parity_with_plain(model)


def check_flat_param_is_only_parameter(rank: int, world_size: int) -> None:
    model = FSDP(NestedWrapped(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    for name, p in model.named_parameters():
        assert isinstance(p, FlatParameter), name
        assert name.endswith("_flat_param"), name
    model = FSDP(NestedWrapped(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    names = [n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters()]
    assert names == [n for n, _ in NestedWrapped().named_parameters()], names
    assert not any(isinstance(p, FlatParameter) for p in model.parameters())


def check_meta_device_init(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        meta_model = NestedWrapped(device="meta")
    model = FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=CPU)
    # reset_parameters() ran per module: values are finite and not all zero, identical on ranks.
    with FSDP.summon_full_params(model):
        for name, p in model.named_parameters():
            assert p.device.type == "cpu" and torch.isfinite(p).all() and p.abs().sum() > 0, name
            gathered = [torch.empty_like(p) for _ in range(world_size)]
            dist.all_gather(gathered, p.detach().contiguous())
            if "weight" in name:
                # Seeds are equal on every rank (the runner seeds each check), so is the init.
                assert_close(gathered[0], gathered[1])


def check_param_init_fn(rank: int, world_size: int) -> None:
    calls: list[str] = []

    def init_fn(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        module.to_empty(device=CPU, recurse=False)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.fill_(0.01)

    meta_model = NestedWrapped(device="meta")
    model = FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), param_init_fn=init_fn)
    # Called per unit on the modules it manages that hold meta states: the four Linears (the
    # root's own modules have no parameters left once the Linears are units).
    assert calls == ["Linear"] * 4, calls
    with FSDP.summon_full_params(model):
        for name, p in model.named_parameters():
            assert torch.all(p == 0.01), name
    model(*NestedWrapped.get_input(step=0, rank=rank)).sum().backward()


def check_sync_module_states(rank: int, world_size: int) -> None:
    torch.manual_seed(100 + rank)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    module[1].running_mean.fill_(float(rank))
    torch.manual_seed(100)
    rank0 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = FSDP(module, sync_module_states=True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    assert torch.all(model.module[1].running_mean == 0.0), "buffers take rank 0's values"
    with FSDP.summon_full_params(model):
        for (n, p), (_, q) in zip(model.named_parameters(), rank0.named_parameters()):
            assert_close(p, q, msg=lambda m: f"{n}: {m}")


def check_ignored_modules(rank: int, world_size: int) -> None:
    for orig in (False, True):
        module = NestedWrapped()
        model = FSDP(module, ignored_modules=[module.out], use_orig_params=orig)
        assert isinstance(module.out.weight, nn.Parameter) and module.out.weight.shape == (5, 12)
        ref = NestedWrapped()
        x = NestedWrapped.get_input(step=0, rank=rank)
        assert_close(model(*x), ref(*x))
        NestedWrapped.get_loss(x, model(*x)).backward()
        assert module.out.weight.grad is not None, "ignored parameters get ordinary local gradients"


def check_param_change_after_init_persists(rank: int, world_size: int) -> None:
    for orig in (False, True):
        x = NestedWrapped.get_input(step=0, rank=rank)
        ref_out = wrap_bottom_up(NestedWrapped(), FSDP, use_orig_params=orig)(*x)
        model = wrap_bottom_up(NestedWrapped(), FSDP, use_orig_params=orig)
        first = next(model.parameters())
        torch.nn.init.normal_(first.data)
        assert not torch.allclose(model(*x), ref_out), "in-place change after init did not persist"


CHECKS = [
    check_module_wrap_policy,
    check_callable_policies,
    check_flat_param_is_only_parameter,
    check_meta_device_init,
    check_param_init_fn,
    check_sync_module_states,
    check_ignored_modules,
    check_param_change_after_init_persists,
]
rank_checks, test_check = rank_check_tests(CHECKS)
