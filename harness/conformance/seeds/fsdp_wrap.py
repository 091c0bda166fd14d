"""Behaviours of torch's test_wrap.py that build units in this process, as conformance tests run
against every engine with torch FSDP1's API (``api``: our engine and torch FSDP1): the already-wrapped
error, BatchNorm wrapped individually (also through ``_or_policy``), ``enable_wrap``/``wrap`` and their
defaults, always-wrap, transformer and module policies, custom policies with per-unit settings,
size-based presets (exclude, force leaf), ignored modules, frozen parameters (error without
``use_orig_params``, warning with it), and the settings every auto-wrapped unit inherits.

Units are built on a process-group double (rank and size only, no communication), as the ported test's
``TestAutoWrap`` does. The training parts of the ported test (main wrap API, auto-wrap smoke test) run in
rank processes in ``harness.conformance.wrap.wrap_engine``.
"""

from __future__ import annotations

import functools
import itertools
import re
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.modules.batchnorm import _BatchNorm

from harness.cases.models import TransformerModel
from harness.conformance.flat_handles import DummyProcessGroup
from harness.conformance.fsdp1_checks import FSDPApi, api
from harness.conformance.wrap.wrap_models import (
    BatchNormContainer,
    BatchNormKinds,
    FourLinears,
    LoraAttention,
    LoraDecoder,
    LoraDecoderStack,
    LoraMLP,
    nested_sequential,
)

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "api",
    "test_error_already_wrapped",
    "test_frozen_params",
    "test_wrap_batchnorm_individually",
    "test_bn_always_wrapped_individually",
    "test_wrap",
    "test_wrap_disabled_outside_context",
    "test_wrap_override_defaults",
    "test_always_wrap",
    "test_transformer_wrapping",
    "test_custom_policy",
    "test_auto_wrap_api",
    "test_auto_wrap_preset_exclude_wrap",
    "test_auto_wrap_preset_exclude_wrap_include_children",
    "test_auto_wrap_preset_force_leaf",
    "test_auto_wrap_preset_force_leaf_custom",
    "test_auto_wrap_with_ignored_modules",
    "test_main_wrap_api_settings",
]

PG = DummyProcessGroup(rank=0, size=1)
LAYER_CLASSES = {TransformerEncoderLayer, TransformerDecoderLayer}


def never_wrap_policy(*args: object, **kwargs: object) -> bool:
    return False


def size_40(api: FSDPApi) -> object:
    return functools.partial(api.policy("size_based_auto_wrap_policy"), min_num_params=40)


def wrap_bn_individually(api: FSDPApi) -> object:
    return functools.partial(api.policy("_wrap_module_cls_individually"), module_classes=[_BatchNorm])


def assert_nested_sequential_wrapped(api: FSDPApi, model: nn.Module) -> None:
    """The ported test's ``verify_model``: only the inner Sequential (60 numel) reaches 40."""
    FSDP = api.FSDP
    assert isinstance(model, FSDP)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1], nn.Linear)
    assert isinstance(model.module[2], FSDP)
    assert isinstance(model.module[2].module[0], nn.Linear) and isinstance(model.module[2].module[1], nn.Linear)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("nested", [True, False])
def test_error_already_wrapped(api: FSDPApi, nested: bool) -> None:
    def unit(fin: int, fout: int) -> nn.Module:
        return api.wrap(nn.Linear(fin, fout, bias=False), process_group=PG)

    model = nn.Module()
    model.lin1 = nn.Sequential(nn.Linear(1, 1, bias=False), unit(1, 1)) if nested else unit(1, 1)
    model.lin2, model.lin3 = unit(1, 1), unit(1, 1)
    name = "lin1.1" if nested else "lin1"
    with pytest.raises(
        ValueError,
        match=f"FSDP auto wrapping requires modules to not already have FSDP applied but found {re.escape(name)} in",
    ):
        api.wrap(model, process_group=PG, auto_wrap_policy=api.policy("size_based_auto_wrap_policy"))


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("policy_name", ["module_wrap_policy", "custom_uniform", "custom_nonuniform"])
def test_frozen_params(api: FSDPApi, policy_name: str, use_orig_params: bool) -> None:
    classes = (LoraAttention, LoraMLP, LoraDecoder)

    def nonuniform(module: nn.Module) -> bool | dict:
        if isinstance(module, LoraAttention):
            return {"sharding_strategy": api.ShardingStrategy.SHARD_GRAD_OP}
        return isinstance(module, classes)

    policy = {
        "module_wrap_policy": api.policy("ModuleWrapPolicy")(classes),
        "custom_uniform": api.policy("CustomPolicy")(lambda m: isinstance(m, classes)),
        "custom_nonuniform": api.policy("CustomPolicy")(nonuniform),
    }[policy_name]
    msg = "layers.0.attn has both parameters with requires_grad=True and False."
    kwargs = {"process_group": DummyProcessGroup(0, 2), "auto_wrap_policy": policy, "use_orig_params": use_orig_params}
    if use_orig_params:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            api.wrap(LoraDecoderStack(), **kwargs)
        messages = [str(w.message) for w in record if issubclass(w.category, UserWarning) and "requires_grad" in str(w.message)]
        assert messages and messages[0].startswith(msg + " We do not recommend wrapping such modules"), messages
    else:
        with pytest.raises(ValueError, match=re.escape(msg + " FSDP does not support wrapping such modules when use_orig_params=False.")):
            api.wrap(LoraDecoderStack(), **kwargs)


# ---------------------------------------------------------------------------- batch norm
@pytest.mark.parametrize("use_or_policy", [True, False])
def test_wrap_batchnorm_individually(api: FSDPApi, use_or_policy: bool) -> None:
    policy = (
        functools.partial(api.policy("_or_policy"), policies=[never_wrap_policy, wrap_bn_individually(api)])
        if use_or_policy
        else wrap_bn_individually(api)
    )
    fsdp = api.wrap(BatchNormKinds(), process_group=PG, auto_wrap_policy=policy)
    for layer in (fsdp.bn1, fsdp.bn2, fsdp.bn3, fsdp.sync_bn):
        assert isinstance(layer, api.FSDP)
    assert not isinstance(fsdp.lin, api.FSDP)


def wrap_bn_container(module: nn.Module, recurse: bool, *args: object, **kwargs: object) -> bool:
    return True if recurse else isinstance(module, BatchNormKinds)


def test_bn_always_wrapped_individually(api: FSDPApi) -> None:
    policy = functools.partial(api.policy("_or_policy"), policies=[wrap_bn_container, wrap_bn_individually(api)])
    fsdp = api.wrap(BatchNormContainer(), process_group=PG, auto_wrap_policy=policy)
    assert isinstance(fsdp.bn_container, api.FSDP)
    container = fsdp.bn_container
    for bn in (container.bn1, container.bn2, container.bn3, container.sync_bn):
        assert isinstance(bn, api.FSDP)

    fsdp = api.wrap(BatchNormContainer(), process_group=PG, auto_wrap_policy=wrap_bn_container)
    assert isinstance(fsdp.bn_container, api.FSDP)
    container = fsdp.bn_container
    for bn in (container.bn1, container.bn2, container.bn3, container.sync_bn):
        assert not isinstance(bn, api.FSDP)


# ---------------------------------------------------------------------------- wrap API and context
@pytest.mark.parametrize("wrap_method", ["ctor", "wrap_api"])
def test_wrap(api: FSDPApi, wrap_method: str) -> None:
    if wrap_method == "wrap_api":
        with api.policy("enable_wrap")(wrapper_cls=api.FSDP, process_group=PG, **api.device_kwargs()):
            layer = api.policy("wrap")(nn.Linear(5, 5))
    else:
        layer = api.wrap(
            nn.Linear(5, 5),
            process_group=PG,
            auto_wrap_policy=functools.partial(api.policy("size_based_auto_wrap_policy"), min_num_params=1),
        )
    assert isinstance(layer, api.FSDP)
    assert layer.rank == PG.rank()
    assert layer.world_size == PG.size()


def test_wrap_disabled_outside_context(api: FSDPApi) -> None:
    wrap = api.policy("wrap")

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = wrap(nn.Linear(5, 5), process_group=PG)

    model = MyModel()
    with api.policy("enable_wrap")(wrapper_cls=api.FSDP, process_group=PG, **api.device_kwargs()):
        model = wrap(model)
    assert isinstance(model, api.FSDP)
    assert not isinstance(model.lin, api.FSDP) and isinstance(model.lin, nn.Linear)


def test_wrap_override_defaults(api: FSDPApi) -> None:
    new_process_group = DummyProcessGroup(rank=0, size=2)
    with api.policy("enable_wrap")(wrapper_cls=api.FSDP, process_group=PG, **api.device_kwargs()):
        layer = api.policy("wrap")(nn.Linear(5, 5), process_group=new_process_group)
    assert isinstance(layer, api.FSDP)
    assert layer.process_group is new_process_group
    assert layer.rank == 0 and layer.world_size == 2


# ---------------------------------------------------------------------------- policies
def test_always_wrap(api: FSDPApi) -> None:
    model = api.wrap(nested_sequential(), process_group=PG, auto_wrap_policy=api.policy("always_wrap_policy"))
    assert isinstance(model, api.FSDP)
    inner = model.module
    for unit in (inner[0], inner[1], inner[2], inner[2].module[0], inner[2].module[1]):
        assert isinstance(unit, api.FSDP)


@pytest.mark.parametrize("policy_name", ["transformer_auto_wrap_policy", "module_wrap_policy", "module_wrap_policy_callable"])
def test_transformer_wrapping(api: FSDPApi, policy_name: str) -> None:
    policy = {
        "transformer_auto_wrap_policy": functools.partial(
            api.policy("transformer_auto_wrap_policy"), transformer_layer_cls=LAYER_CLASSES
        ),
        "module_wrap_policy": api.policy("ModuleWrapPolicy")(LAYER_CLASSES),
        "module_wrap_policy_callable": functools.partial(
            api.policy("_or_policy"), policies=[api.policy("ModuleWrapPolicy")(LAYER_CLASSES)]
        ),
    }[policy_name]
    fsdp_model = api.wrap(TransformerModel(batch_norm=True), process_group=PG, auto_wrap_policy=policy)
    layers = set(fsdp_model.module.transformer.encoder.layers) | set(fsdp_model.module.transformer.decoder.layers)
    for module in fsdp_model.modules():
        assert isinstance(module, api.FSDP) == (module is fsdp_model or module in layers), type(module).__name__


@pytest.mark.parametrize("use_uniform_kwargs", [True, False])
def test_custom_policy(api: FSDPApi, use_uniform_kwargs: bool) -> None:
    strategy, prefetch = api.ShardingStrategy, api.BackwardPrefetch
    model = TransformerModel(batch_norm=True)

    def lambda_fn(module: nn.Module) -> bool | dict:
        if module is model.bn:
            return True if use_uniform_kwargs else {"sharding_strategy": strategy.NO_SHARD}
        if isinstance(module, TransformerEncoderLayer):
            return True
        if isinstance(module, TransformerDecoderLayer):
            if use_uniform_kwargs:
                return True
            return {"sharding_strategy": strategy.SHARD_GRAD_OP, "backward_prefetch": prefetch.BACKWARD_POST}
        return False

    bn, encoders, decoders = model.bn, set(model.transformer.encoder.layers), set(model.transformer.decoder.layers)
    fp16_mp, fp32_mp = api.MixedPrecision(param_dtype=torch.float16), api.MixedPrecision()
    # A size-2 double keeps FULL_SHARD (a one-rank group would become NO_SHARD).
    with pytest.warns(UserWarning, match="mixed precision disabled"):
        fsdp_model = api.wrap(
            model,
            process_group=DummyProcessGroup(0, 2),
            auto_wrap_policy=api.policy("CustomPolicy")(lambda_fn),
            mixed_precision=fp16_mp,
        )
    full, pre = strategy.FULL_SHARD, prefetch.BACKWARD_PRE
    expected = {  # wrapped module: (sharding strategy, backward prefetch, mixed precision)
        model: (full, pre, fp16_mp),
        # Batch norm stays in full precision whatever the policy says.
        bn: (full if use_uniform_kwargs else strategy.NO_SHARD, pre, fp32_mp),
    }
    for layer in encoders:
        expected[layer] = (full, pre, fp16_mp)
    for layer in decoders:
        expected[layer] = (full, pre, fp16_mp) if use_uniform_kwargs else (strategy.SHARD_GRAD_OP, prefetch.BACKWARD_POST, fp16_mp)
    actual = {
        unit.module: (unit.sharding_strategy, unit.backward_prefetch, unit.mixed_precision)
        for unit in fsdp_model.modules()
        if isinstance(unit, api.FSDP)
    }
    assert actual == expected


def test_auto_wrap_api(api: FSDPApi) -> None:
    assert_nested_sequential_wrapped(api, api.wrap(nested_sequential(), process_group=PG, auto_wrap_policy=size_40(api)))


def test_auto_wrap_preset_exclude_wrap(api: FSDPApi) -> None:
    model = api.wrap(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), process_group=PG, auto_wrap_policy=size_40(api))
    assert isinstance(model, api.FSDP)
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.Linear)


def test_auto_wrap_preset_exclude_wrap_include_children(api: FSDPApi) -> None:
    model = api.wrap(nn.ModuleList([nn.Linear(10, 10)]), process_group=PG, auto_wrap_policy=size_40(api))
    assert isinstance(model, api.FSDP) and isinstance(model[0], api.FSDP)


def test_auto_wrap_preset_force_leaf(api: FSDPApi) -> None:
    sequential = nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1))
    model = api.wrap(sequential, process_group=PG, auto_wrap_policy=size_40(api))
    assert isinstance(model.module[0], api.FSDP)
    assert isinstance(model.module[1], nn.MultiheadAttention)
    assert isinstance(model.module[1].out_proj, nn.Linear)


def test_auto_wrap_preset_force_leaf_custom(api: FSDPApi) -> None:
    size_based = api.policy("size_based_auto_wrap_policy")
    policy = functools.partial(
        size_based, min_num_params=40, force_leaf_modules=size_based.FORCE_LEAF_MODULES.union({nn.Linear})
    )
    sequential = nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)]))
    model = api.wrap(sequential, process_group=PG, auto_wrap_policy=policy)
    # Only the root is a unit: nothing inside was wrapped.
    assert isinstance(model, api.FSDP)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1], nn.ModuleList)


# ---------------------------------------------------------------------------- ignored modules
@pytest.mark.parametrize("wrap_method", ["ctor", "wrap_api"])
@pytest.mark.parametrize("policy_name", ["size_based", "always"])
def test_auto_wrap_with_ignored_modules(api: FSDPApi, wrap_method: str, policy_name: str) -> None:
    sequential = nested_sequential()
    ignored = [sequential[1], sequential[2][0]]
    kwargs = {
        "process_group": PG,
        "auto_wrap_policy": size_40(api) if policy_name == "size_based" else api.policy("always_wrap_policy"),
        "ignored_modules": ignored,
    }
    if wrap_method == "ctor":
        model = api.wrap(sequential, **kwargs)
    else:
        with api.policy("enable_wrap")(wrapper_cls=api.FSDP, **kwargs, **api.device_kwargs()):
            model = api.policy("wrap")(sequential)
    FSDP = api.FSDP
    assert isinstance(model, FSDP) and isinstance(model.module[1], nn.Linear)
    if policy_name == "size_based":
        # Without the ignored Linear the inner Sequential (30 numel) no longer reaches 40, so
        # sequential[0] and sequential[2][1] are flattened into the root.
        assert isinstance(model.module[0], nn.Linear)
        assert isinstance(model.module[2], nn.Sequential)
        assert isinstance(model.module[2][0], nn.Linear) and isinstance(model.module[2][1], nn.Linear)
    else:
        assert isinstance(model.module[0], FSDP) and isinstance(model.module[2], FSDP)
        assert isinstance(model.module[2].module[0], nn.Linear) and isinstance(model.module[2].module[1], FSDP)
    # Ignored parameters stay plain parameters of their modules, in no unit.
    for module in ignored:
        assert all(type(p) is nn.Parameter for p in module.parameters())


# ---------------------------------------------------------------------------- settings of auto-wrapped units
@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "offload_params, backward_prefetch, forward_prefetch",
    list(itertools.product([False, True], ["BACKWARD_POST", "BACKWARD_PRE"], [False, True])),
)
def test_main_wrap_api_settings(
    api: FSDPApi, offload_params: bool, backward_prefetch: str, forward_prefetch: bool, mixed_precision: bool
) -> None:
    """Every unit auto wrapping creates carries the root's settings (the ported test's per-unit checks)."""
    cpu_offload = api.CPUOffload(offload_params=offload_params)
    prefetch = api.BackwardPrefetch[backward_prefetch]
    mp = api.MixedPrecision(param_dtype=torch.bfloat16) if mixed_precision else None
    wrapped = api.wrap(
        FourLinears(),
        process_group=DummyProcessGroup(0, 2),
        auto_wrap_policy=functools.partial(api.policy("size_based_auto_wrap_policy"), min_num_params=0),
        cpu_offload=cpu_offload,
        backward_prefetch=prefetch,
        forward_prefetch=forward_prefetch,
        mixed_precision=mp,
    )
    inner = wrapped.module
    units = {
        "lin1": inner.lin1, "lin2": inner.lin2, "lin3": inner.lin3,
        "lin4.nested_lin": inner.lin4.module.nested_lin, "lin4": inner.lin4, "<root>": wrapped,
    }
    expected = (cpu_offload, prefetch, forward_prefetch, mp or api.MixedPrecision())
    for name, unit in units.items():
        assert isinstance(unit, api.FSDP), name
        actual = (unit.cpu_offload, unit.backward_prefetch, unit.forward_prefetch, unit.mixed_precision)
        assert actual == expected, name
