"""Wrapping policies, auto wrapping and the wrap context, without the runtime.

The wrapper here is :class:`RecordingUnit`, which auto-wraps as the runtime's constructor does and
records its kwargs, so these tests pin down *which* modules become units and *with what settings*.
Torch's ``test_wrap.py`` behaviours that need real units (rank/world size from the process group, settings on
the unit objects, training steps) are in ``wrap_engine``; the property test against torch
FSDP1's own wrapping in ``wrap_oracle``.
"""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.modules.batchnorm import _BatchNorm

from engine.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from engine.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    _validate_frozen_params,
    _wrap_module_cls_individually,
    always_wrap_policy,
    auto_wrap,
    enable_wrap,
    lambda_auto_wrap_policy,
    plan_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from harness.cases.models import TransformerModel
from harness.conformance.wrap.wrap_models import (
    BatchNormContainer,
    BatchNormKinds,
    FourLinears,
    LoraAttention,
    LoraDecoder,
    LoraDecoderStack,
    LoraMLP,
    MarkedUnit,
    RecordingUnit,
    nested_sequential,
    recorded,
)

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = [
    "recorded",
    "test_size_based_policy_compares_nonwrapped_numel_with_min_num_params",
    "test_size_based_policy_presets",
    "test_class_policies_always_recurse_and_wrap_instances",
    "test_or_policy_and_always_wrap",
    "test_module_wrap_policy_repr_names_its_classes",
    "test_error_already_wrapped",
    "test_wrap_batchnorm_individually",
    "test_bn_always_wrapped_individually",
    "test_units_are_built_children_first_with_the_root_settings",
    "test_auto_wrap_leaves_root_kwargs_unchanged",
    "test_plan_wrap_is_pure",
    "test_shared_submodule_becomes_one_unit_in_every_parent",
    "test_auto_wrap_api",
    "test_always_wrap",
    "test_auto_wrap_preset_exclude_wrap",
    "test_auto_wrap_preset_exclude_wrap_include_children",
    "test_auto_wrap_preset_force_leaf",
    "test_auto_wrap_preset_force_leaf_custom",
    "test_transformer_wrapping",
    "test_custom_policy",
    "test_custom_policy_rejects_other_results",
    "test_custom_policy_empty_dict_means_no_unit",
    "test_mixed_precision_ignored_classes_get_full_precision_units",
    "test_full_precision_unit_casts_inputs_to_float32_and_outputs_back",
    "test_no_mixed_precision_override_without_mixed_precision",
    "test_auto_wrap_with_ignored_modules",
    "test_children_of_ignored_modules_are_never_wrapped",
    "test_frozen_params",
    "test_frozen_params_accepts_uniform_units",
    "test_validate_frozen_params",
    "test_wrap_in_context_passes_the_context_kwargs",
    "test_wrap_disabled_outside_context",
    "test_wrap_override_defaults",
    "test_nested_enable_wrap_is_refused_and_context_restored_on_error",
]

size_40 = functools.partial(size_based_auto_wrap_policy, min_num_params=40)
wrap_bn_individually = functools.partial(_wrap_module_cls_individually, module_classes=[_BatchNorm])
LAYER_CLASSES = {TransformerEncoderLayer, TransformerDecoderLayer}
DECODER_OVERRIDES = {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "backward_prefetch": BackwardPrefetch.BACKWARD_POST}


def is_unit(module: nn.Module) -> bool:
    return isinstance(module, RecordingUnit)


def never_wrap_policy(*args: object, **kwargs: object) -> bool:
    return False


def wrap_bn_container(module: nn.Module, recurse: bool, *args: object, **kwargs: object) -> bool:
    return True if recurse else isinstance(module, BatchNormKinds)


# ---------------------------------------------------------------------------- policy functions
def test_size_based_policy_compares_nonwrapped_numel_with_min_num_params() -> None:
    lin = nn.Linear(5, 5)
    for recurse in (True, False):
        assert not size_based_auto_wrap_policy(lin, recurse, nonwrapped_numel=39, min_num_params=40)
        assert size_based_auto_wrap_policy(lin, recurse, nonwrapped_numel=40, min_num_params=40)
    # The default threshold is 1e8 numel.
    assert not size_based_auto_wrap_policy(lin, False, nonwrapped_numel=10**8 - 1)
    assert size_based_auto_wrap_policy(lin, False, nonwrapped_numel=10**8)


def test_size_based_policy_presets() -> None:
    assert size_based_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}
    mha, mlist = nn.MultiheadAttention(4, 1), nn.ModuleList()
    # A forced leaf is never descended into but may be wrapped; an excluded container the reverse.
    assert not size_based_auto_wrap_policy(mha, True, nonwrapped_numel=100, min_num_params=1)
    assert size_based_auto_wrap_policy(mha, False, nonwrapped_numel=100, min_num_params=1)
    assert size_based_auto_wrap_policy(mlist, True, nonwrapped_numel=100, min_num_params=1)
    assert not size_based_auto_wrap_policy(mlist, False, nonwrapped_numel=100, min_num_params=1)
    # Explicit sets replace the presets.
    assert size_based_auto_wrap_policy(mha, True, 100, min_num_params=1, force_leaf_modules=set())
    assert size_based_auto_wrap_policy(mlist, False, 100, min_num_params=1, exclude_wrap_modules=set())


@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}),
        ModuleWrapPolicy({nn.Linear}),
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
        functools.partial(_wrap_module_cls_individually, module_classes=[nn.Linear]),
        functools.partial(_or_policy, policies=[never_wrap_policy, ModuleWrapPolicy({nn.Linear})]),
    ],
    ids=["transformer", "module_wrap_callable", "lambda", "cls_individually", "or"],
)
def test_class_policies_always_recurse_and_wrap_instances(policy) -> None:
    for module in (nn.Linear(2, 2), nn.Sequential(), nn.ReLU()):
        assert policy(module=module, recurse=True, nonwrapped_numel=0)
    assert policy(module=nn.Linear(2, 2), recurse=False, nonwrapped_numel=0)
    assert not policy(module=nn.Sequential(), recurse=False, nonwrapped_numel=0)


def test_or_policy_and_always_wrap() -> None:
    lin = nn.Linear(2, 2)
    assert not _or_policy(lin, False, 0, policies=[never_wrap_policy, never_wrap_policy])
    assert _or_policy(lin, False, 0, policies=[never_wrap_policy, always_wrap_policy])
    assert always_wrap_policy(lin, False, 0) and always_wrap_policy()


def test_module_wrap_policy_repr_names_its_classes() -> None:
    assert repr(ModuleWrapPolicy([nn.Linear, nn.ReLU])) == "ModuleWrapPolicy({Linear, ReLU})"


# ---------------------------------------------------------------------------- already wrapped
def already_wrapped_model(nested: bool, unit_cls: type[nn.Module]) -> nn.Module:
    model = nn.Module()
    if nested:
        model.lin1 = nn.Sequential(nn.Linear(1, 1, bias=False), unit_cls(nn.Linear(1, 1, bias=False)))
    else:
        model.lin1 = unit_cls(nn.Linear(1, 1, bias=False))
    model.lin2 = unit_cls(nn.Linear(1, 1, bias=False))
    model.lin3 = unit_cls(nn.Linear(1, 1, bias=False))
    return model


@pytest.mark.parametrize("unit_cls", [RecordingUnit, MarkedUnit], ids=["same_class", "marker"])
@pytest.mark.parametrize("nested", [True, False])
def test_error_already_wrapped(nested: bool, unit_cls: type[nn.Module]) -> None:
    model = already_wrapped_model(nested, unit_cls)
    name = "lin1.1" if nested else "lin1"
    with pytest.raises(
        ValueError,
        match=f"^FSDP auto wrapping requires modules to not already have FSDP applied but found {re.escape(name)} in\n",
    ):
        RecordingUnit(model, auto_wrap_policy=size_based_auto_wrap_policy)


# ---------------------------------------------------------------------------- batch norm
@pytest.mark.parametrize("use_or_policy", [True, False])
def test_wrap_batchnorm_individually(use_or_policy: bool) -> None:
    policy = (
        functools.partial(_or_policy, policies=[never_wrap_policy, wrap_bn_individually])
        if use_or_policy
        else wrap_bn_individually
    )
    model = RecordingUnit(BatchNormKinds(), auto_wrap_policy=policy).module
    for layer in (model.bn1, model.bn2, model.bn3, model.sync_bn):
        assert is_unit(layer)
    assert not is_unit(model.lin)


def test_bn_always_wrapped_individually() -> None:
    policy = functools.partial(_or_policy, policies=[wrap_bn_container, wrap_bn_individually])
    model = RecordingUnit(BatchNormContainer(), auto_wrap_policy=policy).module
    # Unit(Unit(BatchNormKinds(Unit(BN)))), not Unit(Unit(BatchNormKinds(BN))).
    assert is_unit(model.bn_container)
    inner = model.bn_container.module
    for bn in (inner.bn1, inner.bn2, inner.bn3, inner.sync_bn):
        assert is_unit(bn)

    # The container policy alone leaves the batch norms inside the container's unit.
    model = RecordingUnit(BatchNormContainer(), auto_wrap_policy=wrap_bn_container).module
    assert is_unit(model.bn_container)
    inner = model.bn_container.module
    for bn in (inner.bn1, inner.bn2, inner.bn3, inner.sync_bn):
        assert not is_unit(bn)


# ---------------------------------------------------------------------------- main wrap API structure
def test_units_are_built_children_first_with_the_root_settings(recorded: list[RecordingUnit]) -> None:
    settings = {
        "cpu_offload": CPUOffload(offload_params=True),
        "backward_prefetch": BackwardPrefetch.BACKWARD_POST,
        "forward_prefetch": True,
        "mixed_precision": MixedPrecision(param_dtype=torch.float16, _module_classes_to_ignore=()),
    }
    model = FourLinears()
    expected_order = [model.lin1, model.lin2, model.lin3, model.lin4.nested_lin, model.lin4, model]
    root = RecordingUnit(
        model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=0), **settings
    )
    assert [unit.module for unit in recorded] == expected_order
    assert recorded[-1] is root
    for unit in recorded:
        assert unit.kwargs == settings
    # Each unit holds its own copy: a per-unit change must not reach the others.
    assert len({id(unit.kwargs) for unit in recorded}) == len(recorded)


def test_auto_wrap_leaves_root_kwargs_unchanged() -> None:
    root_kwargs = {"auto_wrap_policy": always_wrap_policy, "forward_prefetch": True}
    snapshot = dict(root_kwargs)
    auto_wrap(nested_sequential(), always_wrap_policy, RecordingUnit, set(), set(), root_kwargs)
    assert root_kwargs == snapshot


def test_plan_wrap_is_pure() -> None:
    model = nested_sequential()
    before = [type(m) for m in model.modules()]
    targets = plan_wrap(model, size_40, set(), set(), {"x": 1})
    assert list(targets) == [model[2]]
    assert [type(m) for m in model.modules()] == before


def test_shared_submodule_becomes_one_unit_in_every_parent(recorded: list[RecordingUnit]) -> None:
    shared = nn.Linear(3, 3)
    model = nn.Module()
    model.a, model.b = nn.Sequential(shared), nn.Sequential(shared)
    policy = functools.partial(_wrap_module_cls_individually, module_classes=[nn.Linear])
    RecordingUnit(model, auto_wrap_policy=policy)
    assert is_unit(model.a[0]) and model.a[0] is model.b[0]
    assert [unit.module for unit in recorded].count(shared) == 1


# ---------------------------------------------------------------------------- size-based policy
def test_auto_wrap_api() -> None:
    # One Linear(5, 5) (30 numel) is under 40, the inner pair (60) is not.
    model = RecordingUnit(nested_sequential(), auto_wrap_policy=size_40)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1], nn.Linear)
    assert is_unit(model.module[2])
    assert isinstance(model.module[2].module[0], nn.Linear) and isinstance(model.module[2].module[1], nn.Linear)


def test_always_wrap() -> None:
    model = RecordingUnit(nested_sequential(), auto_wrap_policy=always_wrap_policy)
    assert all(is_unit(m) for m in (model.module[0], model.module[1], model.module[2]))
    assert is_unit(model.module[2].module[0]) and is_unit(model.module[2].module[1])


def test_auto_wrap_preset_exclude_wrap() -> None:
    model = RecordingUnit(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), auto_wrap_policy=size_40)
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.Linear)


def test_auto_wrap_preset_exclude_wrap_include_children() -> None:
    model = RecordingUnit(nn.ModuleList([nn.Linear(10, 10)]), auto_wrap_policy=size_40)
    assert is_unit(model[0])


def test_auto_wrap_preset_force_leaf() -> None:
    model = RecordingUnit(nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)), auto_wrap_policy=size_40)
    assert is_unit(model.module[0])
    # A forced leaf is not entered, and so neither it nor its children become units.
    assert isinstance(model.module[1], nn.MultiheadAttention)
    assert isinstance(model.module[1].out_proj, nn.Linear)


def test_auto_wrap_preset_force_leaf_custom() -> None:
    policy = functools.partial(
        size_based_auto_wrap_policy,
        min_num_params=40,
        force_leaf_modules=size_based_auto_wrap_policy.FORCE_LEAF_MODULES.union({nn.Linear}),
    )
    model = RecordingUnit(nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])), auto_wrap_policy=policy)
    # Nothing inside became a unit: the Linears are forced leaves, the ModuleList is excluded.
    assert is_unit(model)
    assert isinstance(model.module[0], nn.Linear)
    assert isinstance(model.module[1], nn.ModuleList) and isinstance(model.module[1][0], nn.Linear)


# ---------------------------------------------------------------------------- class policies
@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=LAYER_CLASSES),
        ModuleWrapPolicy(LAYER_CLASSES),
        functools.partial(_or_policy, policies=[ModuleWrapPolicy(LAYER_CLASSES)]),
    ],
    ids=["transformer_auto_wrap_policy", "module_wrap_policy", "module_wrap_policy_callable"],
)
def test_transformer_wrapping(policy) -> None:
    root = RecordingUnit(TransformerModel(batch_norm=True), auto_wrap_policy=policy)
    layers = set(root.module.transformer.encoder.layers) | set(root.module.transformer.decoder.layers)
    assert len(layers) == 4
    for module in root.modules():
        assert is_unit(module) == (module is root or module in layers), module


@pytest.mark.parametrize("use_uniform_kwargs", [True, False])
def test_custom_policy(use_uniform_kwargs: bool) -> None:
    model = TransformerModel(batch_norm=True)
    if use_uniform_kwargs:

        def lambda_fn(module: nn.Module) -> bool | dict:
            return module is model.bn or isinstance(module, (TransformerEncoderLayer, TransformerDecoderLayer))

    else:

        def lambda_fn(module: nn.Module) -> bool | dict:
            if module is model.bn:
                return {"sharding_strategy": ShardingStrategy.NO_SHARD}
            if isinstance(module, TransformerEncoderLayer):
                return True
            if isinstance(module, TransformerDecoderLayer):
                return DECODER_OVERRIDES
            return False

    bn, encoders, decoders = model.bn, set(model.transformer.encoder.layers), set(model.transformer.decoder.layers)
    fp16_mp = MixedPrecision(param_dtype=torch.float16)
    root_settings = {
        "sharding_strategy": ShardingStrategy.FULL_SHARD,
        "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
        "mixed_precision": fp16_mp,
    }
    with pytest.warns(UserWarning, match="BatchNorm1d"):
        root = RecordingUnit(model, auto_wrap_policy=CustomPolicy(lambda_fn), **root_settings)
    expected_decoder = dict(root_settings)
    expected_bn = dict(root_settings, mixed_precision=None)  # batch norm stays in full precision
    if not use_uniform_kwargs:
        expected_decoder.update(DECODER_OVERRIDES)
        expected_bn.update(sharding_strategy=ShardingStrategy.NO_SHARD)
    kwargs_of = {unit.module: unit.kwargs for unit in root.modules() if is_unit(unit)}
    assert set(kwargs_of) == {model, bn} | encoders | decoders
    assert kwargs_of[model] == root_settings
    assert kwargs_of[bn] == expected_bn
    for layer in encoders:
        assert kwargs_of[layer] == root_settings
    for layer in decoders:
        assert kwargs_of[layer] == expected_decoder


@pytest.mark.parametrize("bad", [1, None, "yes", [True]])
def test_custom_policy_rejects_other_results(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"but it returned {bad!r}")):
        RecordingUnit(nested_sequential(), auto_wrap_policy=CustomPolicy(lambda module: bad))


def test_custom_policy_empty_dict_means_no_unit() -> None:
    policy = CustomPolicy(lambda m: {} if isinstance(m, nn.Linear) else False)
    model = RecordingUnit(nested_sequential(), auto_wrap_policy=policy)
    assert not any(is_unit(m) for m in model.module.modules())


# ---------------------------------------------------------------------------- mixed precision classes
def test_mixed_precision_ignored_classes_get_full_precision_units() -> None:
    mp = MixedPrecision(param_dtype=torch.float16)
    with pytest.warns(UserWarning, match="mixed precision disabled"):
        root = RecordingUnit(BatchNormContainer(), auto_wrap_policy=never_wrap_policy, mixed_precision=mp)
    inner = root.module.bn_container
    for bn in (inner.bn1, inner.bn2, inner.bn3, inner.sync_bn):
        assert is_unit(bn) and bn.kwargs == {"mixed_precision": None}
    assert not is_unit(inner) and not is_unit(inner.lin)


def test_full_precision_unit_casts_inputs_to_float32_and_outputs_back() -> None:
    mp = MixedPrecision(param_dtype=torch.float16)
    model = nn.Sequential(nn.BatchNorm1d(4))
    with pytest.warns(UserWarning):
        root = RecordingUnit(model, auto_wrap_policy=never_wrap_policy, mixed_precision=mp)
    x = torch.randn(3, 4)
    out = root(x.half())
    assert out.dtype == torch.float16
    reference = nn.functional.batch_norm(x.half().float(), None, None, training=True)
    torch.testing.assert_close(out, reference.half())


def test_no_mixed_precision_override_without_mixed_precision() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = RecordingUnit(BatchNormContainer(), auto_wrap_policy=never_wrap_policy)
    assert not any(is_unit(m) for m in root.module.modules())


# ---------------------------------------------------------------------------- ignored modules
@pytest.mark.parametrize("wrap_method", ["ctor", "wrap_api"])
@pytest.mark.parametrize("policy_name", ["size_based", "always"])
def test_auto_wrap_with_ignored_modules(wrap_method: str, policy_name: str) -> None:
    model = nested_sequential()
    kwargs = {
        "auto_wrap_policy": size_40 if policy_name == "size_based" else always_wrap_policy,
        "ignored_modules": [model[1], model[2][0]],
    }
    if wrap_method == "ctor":
        root = RecordingUnit(model, **kwargs)
    else:
        with enable_wrap(wrapper_cls=RecordingUnit, **kwargs):
            root = wrap(model)
    assert is_unit(root) and isinstance(root.module[1], nn.Linear)
    if policy_name == "size_based":
        # Without the ignored Linear, the inner Sequential (30 numel) no longer reaches 40.
        assert isinstance(root.module[0], nn.Linear)
        assert isinstance(root.module[2], nn.Sequential)
        assert isinstance(root.module[2][0], nn.Linear) and isinstance(root.module[2][1], nn.Linear)
    else:
        assert is_unit(root.module[0]) and is_unit(root.module[2])
        assert isinstance(root.module[2].module[0], nn.Linear) and is_unit(root.module[2].module[1])


def test_children_of_ignored_modules_are_never_wrapped() -> None:
    model = nested_sequential()
    policy = CustomPolicy(lambda m: isinstance(m, nn.Linear))
    root = RecordingUnit(model, auto_wrap_policy=policy, ignored_modules=[model[2]])
    assert is_unit(root.module[0]) and is_unit(root.module[1])
    assert isinstance(root.module[2][0], nn.Linear) and isinstance(root.module[2][1], nn.Linear)


# ---------------------------------------------------------------------------- frozen parameters
LORA_CLASSES = (LoraAttention, LoraMLP, LoraDecoder)


def _nonuniform_lora(module: nn.Module) -> bool | dict:
    if isinstance(module, LoraAttention):
        return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
    return isinstance(module, LORA_CLASSES)


FROZEN_POLICIES = {
    "module_wrap_policy": ModuleWrapPolicy(LORA_CLASSES),
    "custom_uniform": CustomPolicy(lambda m: isinstance(m, LORA_CLASSES)),
    "custom_nonuniform": CustomPolicy(_nonuniform_lora),
    "transformer_callable": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(LORA_CLASSES)),
}


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("policy_name", list(FROZEN_POLICIES))
def test_frozen_params(policy_name: str, use_orig_params: bool) -> None:
    msg = "layers.0.attn has both parameters with requires_grad=True and False. "
    kwargs = {"auto_wrap_policy": FROZEN_POLICIES[policy_name], "use_orig_params": use_orig_params}
    if use_orig_params:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            RecordingUnit(LoraDecoderStack(), **kwargs)
        # One warning per decoder layer's attention, the first registered first.
        assert [w.category for w in record] == [UserWarning] * 4
        assert str(record[0].message).startswith(msg + "We do not recommend wrapping such modules")
    else:
        msg += "FSDP does not support wrapping such modules when use_orig_params=False."
        with pytest.raises(ValueError, match=re.escape(msg)):
            RecordingUnit(LoraDecoderStack(), **kwargs)


def test_frozen_params_accepts_uniform_units() -> None:
    lora = CustomPolicy(lambda m: isinstance(m, (LoraAttention, LoraDecoder)) or _is_lora_linear(m))
    model = LoraDecoderStack()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = RecordingUnit(model, auto_wrap_policy=lora, use_orig_params=False)
    # Every unit the policy chose was built, each holding parameters of one requires_grad value only.
    units = [m for m in root.modules() if isinstance(m, RecordingUnit) and m is not root]
    expected = sum(1 for m in model.modules() if isinstance(m, (LoraAttention, LoraDecoder)) or _is_lora_linear(m))
    assert len(units) == expected > 0
    for unit in units:
        own = [p for p in unit.module.parameters(recurse=False)]
        assert len({p.requires_grad for p in own}) <= 1


def _is_lora_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.requires_grad


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_validate_frozen_params(use_orig_params: bool) -> None:
    model = LoraDecoderStack()
    lora = {m for name, m in model.named_modules() if "lora_A" in name or "lora_B" in name}
    attns = {m for m in model.modules() if isinstance(m, LoraAttention)}
    decoders = {m for m in model.modules() if isinstance(m, LoraDecoder)}
    # Adapters alone, then with attention, then with decoders: every unit is uniform.
    for modules in (lora, lora | attns, lora | attns | decoders):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _validate_frozen_params(model, modules, set(), use_orig_params)

    # Without its own unit, lora_A's trainable weight joins the frozen projections in the attention's.
    without_a = {m for name, m in model.named_modules() if "lora_B" in name} | attns | decoders
    expected = "layers.0.attn has both parameters with requires_grad=True and False."
    if use_orig_params:
        expected += (
            " We do not recommend wrapping such modules since the gradient memory usage will be higher than "
            "expected (4352 numel instead of 256 numel before sharding via reduce-scatter). "
        )
    else:
        expected += " FSDP does not support wrapping such modules when use_orig_params=False. "
    expected += (
        "If possible, wrap the frozen parameters with FSDP separately.\n"
        "The following parameters have requires_grad=True:\n['layers.0.attn.lora_A.weight']\n"
        "The following parameters have requires_grad=False:\n['layers.0.attn.q_proj.weight', "
        "'layers.0.attn.k_proj.weight', 'layers.0.attn.v_proj.weight', 'layers.0.attn.o_proj.weight']"
    )
    if use_orig_params:
        with pytest.warns(UserWarning) as record:
            _validate_frozen_params(model, without_a, set(), use_orig_params)
        # One warning per offending attention, the first one registered first.
        assert len(record) == 4 and str(record[0].message) == expected
    else:
        with pytest.raises(ValueError) as info:
            _validate_frozen_params(model, without_a, set(), use_orig_params)
        assert str(info.value) == expected

    # Ignoring the lora_A parameters leaves the attention units all frozen.
    ignored = {p for name, m in model.named_modules() if "lora_A" in name for p in m.parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _validate_frozen_params(model, without_a, ignored, use_orig_params)


# ---------------------------------------------------------------------------- wrap context
def test_wrap_in_context_passes_the_context_kwargs() -> None:
    with enable_wrap(wrapper_cls=RecordingUnit, process_group="pg", forward_prefetch=True):
        layer = wrap(nn.Linear(5, 5))
    assert is_unit(layer) and layer.kwargs == {"process_group": "pg", "forward_prefetch": True}


def test_wrap_disabled_outside_context() -> None:
    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = wrap(nn.Linear(5, 5), process_group="pg")

    model = MyModel()
    assert isinstance(model.lin, nn.Linear)
    with enable_wrap(wrapper_cls=RecordingUnit, process_group="pg"):
        model = wrap(model)
    assert is_unit(model) and isinstance(model.module.lin, nn.Linear)
    assert wrap(nn.Linear(1, 1)).__class__ is nn.Linear  # the context is over


def test_wrap_override_defaults() -> None:
    with enable_wrap(wrapper_cls=RecordingUnit, process_group="default", forward_prefetch=True):
        layer = wrap(nn.Linear(5, 5), process_group="override")
    assert layer.kwargs == {"process_group": "override", "forward_prefetch": True}


def test_nested_enable_wrap_is_refused_and_context_restored_on_error() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=RecordingUnit):
            with pytest.raises(NotImplementedError, match="nested wrap contexts"):
                with enable_wrap(wrapper_cls=RecordingUnit):
                    pass
            raise RuntimeError("boom")
    assert isinstance(wrap(nn.Linear(1, 1)), nn.Linear)
    with enable_wrap(wrapper_cls=RecordingUnit):
        assert is_unit(wrap(nn.Linear(1, 1)))
