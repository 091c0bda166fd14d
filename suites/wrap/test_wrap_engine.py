"""The seed's ``test_wrap.py`` against our engine's ``FullyShardedDataParallel``.

Structure tests build real units in this process on a process-group double (rank and size only,
no communication), as the seed's ``TestAutoWrap`` does. The main wrap API and the auto-wrap smoke
test train in rank processes (:mod:`wrap_jobs`): on two gloo CPU ranks (one for the smoke test,
the seed's world-size-1 group) and, where there are GPUs, on NCCL with the seed's CUDA init modes
and ``device_id``.
"""

from __future__ import annotations

import functools
import itertools
import re
import warnings

import pytest
import torch
import torch.nn as nn
import wrap_jobs
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.modules.batchnorm import _BatchNorm
from wrap_models import (
    BatchNormContainer,
    BatchNormNet,
    DummyProcessGroup,
    FourLinears,
    LoraAttention,
    LoraDecoder,
    LoraMLP,
    LoraModel,
    SharedParamsTransformer,
    nested_sequential,
)

from engine import BackwardPrefetch, CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from engine.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    _wrap_module_cls_individually,
    always_wrap_policy,
    enable_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from harness.pool import RankPool

PG = DummyProcessGroup(rank=0, size=1)

size_40 = functools.partial(size_based_auto_wrap_policy, min_num_params=40)
wrap_bn_individually = functools.partial(_wrap_module_cls_individually, module_classes=[_BatchNorm])
LAYER_CLASSES = {TransformerEncoderLayer, TransformerDecoderLayer}
POST = BackwardPrefetch.BACKWARD_POST


def never_wrap_policy(*args: object, **kwargs: object) -> bool:
    return False


def assert_nested_sequential_wrapped(model: nn.Module) -> None:
    """The seed's ``verify_model``: only the inner Sequential (60 numel) reaches 40."""
    assert isinstance(model, FSDP)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1], nn.Linear)
    assert isinstance(model.module[2], FSDP)
    assert isinstance(model.module[2].module[0], nn.Linear) and isinstance(model.module[2].module[1], nn.Linear)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("nested", [True, False])
def test_error_already_wrapped(nested: bool) -> None:
    def unit(fin: int, fout: int) -> FSDP:
        return FSDP(nn.Linear(fin, fout, bias=False), process_group=PG)

    model = nn.Module()
    model.lin1 = nn.Sequential(nn.Linear(1, 1, bias=False), unit(1, 1)) if nested else unit(1, 1)
    model.lin2, model.lin3 = unit(1, 1), unit(1, 1)
    name = "lin1.1" if nested else "lin1"
    with pytest.raises(
        ValueError,
        match=f"FSDP auto wrapping requires modules to not already have FSDP applied but found {re.escape(name)} in",
    ):
        FSDP(model, process_group=PG, auto_wrap_policy=size_based_auto_wrap_policy)


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("policy_name", ["module_wrap_policy", "custom_uniform", "custom_nonuniform"])
def test_frozen_params(policy_name: str, use_orig_params: bool) -> None:
    classes = (LoraAttention, LoraMLP, LoraDecoder)

    def nonuniform(module: nn.Module) -> bool | dict:
        if isinstance(module, LoraAttention):
            return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
        return isinstance(module, classes)

    policy = {
        "module_wrap_policy": ModuleWrapPolicy(classes),
        "custom_uniform": CustomPolicy(lambda m: isinstance(m, classes)),
        "custom_nonuniform": CustomPolicy(nonuniform),
    }[policy_name]
    msg = "layers.0.attn has both parameters with requires_grad=True and False. "
    kwargs = {"process_group": DummyProcessGroup(0, 2), "auto_wrap_policy": policy, "use_orig_params": use_orig_params}
    if use_orig_params:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            FSDP(LoraModel(), **kwargs)
        messages = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
        assert messages and messages[0].startswith(msg + "We do not recommend wrapping such modules"), messages
    else:
        msg += "FSDP does not support wrapping such modules when use_orig_params=False."
        with pytest.raises(ValueError, match=re.escape(msg)):
            FSDP(LoraModel(), **kwargs)


# ---------------------------------------------------------------------------- batch norm
@pytest.mark.parametrize("use_or_policy", [True, False])
def test_wrap_batchnorm_individually(use_or_policy: bool) -> None:
    policy = (
        functools.partial(_or_policy, policies=[never_wrap_policy, wrap_bn_individually])
        if use_or_policy
        else wrap_bn_individually
    )
    fsdp = FSDP(BatchNormNet(), process_group=PG, auto_wrap_policy=policy)
    for layer in (fsdp.bn1, fsdp.bn2, fsdp.bn3, fsdp.sync_bn):
        assert isinstance(layer, FSDP)
    assert not isinstance(fsdp.lin, FSDP)


def wrap_bn_container(module: nn.Module, recurse: bool, *args: object, **kwargs: object) -> bool:
    return True if recurse else isinstance(module, BatchNormNet)


def test_bn_always_wrapped_individually() -> None:
    policy = functools.partial(_or_policy, policies=[wrap_bn_container, wrap_bn_individually])
    fsdp = FSDP(BatchNormContainer(), process_group=PG, auto_wrap_policy=policy)
    assert isinstance(fsdp.bn_container, FSDP)
    for bn in (fsdp.bn_container.bn1, fsdp.bn_container.bn2, fsdp.bn_container.bn3, fsdp.bn_container.sync_bn):
        assert isinstance(bn, FSDP)

    fsdp = FSDP(BatchNormContainer(), process_group=PG, auto_wrap_policy=wrap_bn_container)
    assert isinstance(fsdp.bn_container, FSDP)
    for bn in (fsdp.bn_container.bn1, fsdp.bn_container.bn2, fsdp.bn_container.bn3, fsdp.bn_container.sync_bn):
        assert not isinstance(bn, FSDP)


# ---------------------------------------------------------------------------- wrap API and context
@pytest.mark.parametrize("wrap_method", ["ctor", "wrap_api"])
def test_wrap(wrap_method: str) -> None:
    if wrap_method == "wrap_api":
        with enable_wrap(wrapper_cls=FSDP, process_group=PG):
            layer = wrap(nn.Linear(5, 5))
    else:
        layer = FSDP(
            nn.Linear(5, 5),
            process_group=PG,
            auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1),
        )
    assert isinstance(layer, FSDP)
    assert layer.rank == PG.rank()
    assert layer.world_size == PG.size()


def test_wrap_disabled_outside_context() -> None:
    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = wrap(nn.Linear(5, 5), process_group=PG)

    model = MyModel()
    with enable_wrap(wrapper_cls=FSDP, process_group=PG):
        model = wrap(model)
    assert isinstance(model, FSDP)
    assert not isinstance(model.lin, FSDP) and isinstance(model.lin, nn.Linear)


def test_wrap_override_defaults() -> None:
    new_process_group = DummyProcessGroup(rank=0, size=2)
    with enable_wrap(wrapper_cls=FSDP, process_group=PG):
        layer = wrap(nn.Linear(5, 5), process_group=new_process_group)
    assert isinstance(layer, FSDP)
    assert layer.process_group is new_process_group
    assert layer.rank == 0 and layer.world_size == 2


# ---------------------------------------------------------------------------- policies
def test_always_wrap() -> None:
    model = FSDP(nested_sequential(), process_group=PG, auto_wrap_policy=always_wrap_policy)
    assert isinstance(model, FSDP)
    inner = model.module
    for unit in (inner[0], inner[1], inner[2], inner[2].module[0], inner[2].module[1]):
        assert isinstance(unit, FSDP)


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
    fsdp_model = FSDP(SharedParamsTransformer(), process_group=PG, auto_wrap_policy=policy)
    layers = set(fsdp_model.module.transformer.encoder.layers) | set(fsdp_model.module.transformer.decoder.layers)
    for module in fsdp_model.modules():
        assert isinstance(module, FSDP) == (module is fsdp_model or module in layers), type(module).__name__


@pytest.mark.parametrize("use_uniform_kwargs", [True, False])
def test_custom_policy(use_uniform_kwargs: bool) -> None:
    model = SharedParamsTransformer()

    def lambda_fn(module: nn.Module) -> bool | dict:
        if module is model.bn:
            return True if use_uniform_kwargs else {"sharding_strategy": ShardingStrategy.NO_SHARD}
        if isinstance(module, TransformerEncoderLayer):
            return True
        if isinstance(module, TransformerDecoderLayer):
            if use_uniform_kwargs:
                return True
            return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "backward_prefetch": POST}
        return False

    bn, encoders, decoders = model.bn, set(model.transformer.encoder.layers), set(model.transformer.decoder.layers)
    fp16_mp, fp32_mp = MixedPrecision(param_dtype=torch.float16), MixedPrecision()
    # A size-2 double keeps FULL_SHARD (a one-rank group would become NO_SHARD).
    with pytest.warns(UserWarning, match="mixed precision disabled"):
        fsdp_model = FSDP(
            model,
            process_group=DummyProcessGroup(0, 2),
            auto_wrap_policy=CustomPolicy(lambda_fn),
            mixed_precision=fp16_mp,
        )
    full, pre = ShardingStrategy.FULL_SHARD, BackwardPrefetch.BACKWARD_PRE
    expected = {  # wrapped module: (sharding strategy, backward prefetch, mixed precision)
        model: (full, pre, fp16_mp),
        # Batch norm stays in full precision whatever the policy says.
        bn: (full if use_uniform_kwargs else ShardingStrategy.NO_SHARD, pre, fp32_mp),
    }
    for layer in encoders:
        expected[layer] = (full, pre, fp16_mp)
    for layer in decoders:
        expected[layer] = (full, pre, fp16_mp) if use_uniform_kwargs else (ShardingStrategy.SHARD_GRAD_OP, POST, fp16_mp)
    actual = {
        unit.module: (unit.sharding_strategy, unit.backward_prefetch, unit.mixed_precision)
        for unit in fsdp_model.modules()
        if isinstance(unit, FSDP)
    }
    assert actual == expected


def test_auto_wrap_api() -> None:
    assert_nested_sequential_wrapped(FSDP(nested_sequential(), process_group=PG, auto_wrap_policy=size_40))


def test_auto_wrap_preset_exclude_wrap() -> None:
    model = FSDP(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), process_group=PG, auto_wrap_policy=size_40)
    assert isinstance(model, FSDP)
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.Linear)


def test_auto_wrap_preset_exclude_wrap_include_children() -> None:
    model = FSDP(nn.ModuleList([nn.Linear(10, 10)]), process_group=PG, auto_wrap_policy=size_40)
    assert isinstance(model, FSDP) and isinstance(model[0], FSDP)


def test_auto_wrap_preset_force_leaf() -> None:
    sequential = nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1))
    model = FSDP(sequential, process_group=PG, auto_wrap_policy=size_40)
    assert isinstance(model.module[0], FSDP)
    assert isinstance(model.module[1], nn.MultiheadAttention)
    assert isinstance(model.module[1].out_proj, nn.Linear)


def test_auto_wrap_preset_force_leaf_custom() -> None:
    policy = functools.partial(
        size_based_auto_wrap_policy,
        min_num_params=40,
        force_leaf_modules=size_based_auto_wrap_policy.FORCE_LEAF_MODULES.union({nn.Linear}),
    )
    sequential = nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)]))
    model = FSDP(sequential, process_group=PG, auto_wrap_policy=policy)
    # Only the root is a unit: nothing inside was wrapped.
    assert isinstance(model, FSDP)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1], nn.ModuleList)


# ---------------------------------------------------------------------------- ignored modules
@pytest.mark.parametrize("wrap_method", ["ctor", "wrap_api"])
@pytest.mark.parametrize("policy_name", ["size_based", "always"])
def test_auto_wrap_with_ignored_modules(wrap_method: str, policy_name: str) -> None:
    sequential = nested_sequential()
    ignored = [sequential[1], sequential[2][0]]
    kwargs = {
        "process_group": PG,
        "auto_wrap_policy": size_40 if policy_name == "size_based" else always_wrap_policy,
        "ignored_modules": ignored,
    }
    if wrap_method == "ctor":
        model = FSDP(sequential, **kwargs)
    else:
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            model = wrap(sequential)
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


@pytest.mark.parametrize("mixed_precision", [None, MixedPrecision(param_dtype=torch.bfloat16)], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "offload_params, backward_prefetch, forward_prefetch",
    list(itertools.product([False, True], [BackwardPrefetch.BACKWARD_POST, BackwardPrefetch.BACKWARD_PRE], [False, True])),
)
def test_main_wrap_api_settings(
    offload_params: bool,
    backward_prefetch: BackwardPrefetch,
    forward_prefetch: bool,
    mixed_precision: MixedPrecision | None,
) -> None:
    """Every unit auto wrapping creates carries the root's settings (the seed's per-unit checks)."""
    cpu_offload = CPUOffload(offload_params=offload_params)
    wrapped = FSDP(
        FourLinears(),
        process_group=DummyProcessGroup(0, 2),
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=0),
        cpu_offload=cpu_offload,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        mixed_precision=mixed_precision,
    )
    expected = (cpu_offload, backward_prefetch, forward_prefetch, mixed_precision or MixedPrecision())
    for name, unit in wrap_jobs.units_in_graph_order(wrapped).items():
        assert isinstance(unit, FSDP), name
        actual = (unit.cpu_offload, unit.backward_prefetch, unit.forward_prefetch, unit.mixed_precision)
        assert actual == expected, name


# ---------------------------------------------------------------------------- training in rank processes
INIT_MODES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda_before", id="cuda_before", marks=pytest.mark.gpu),
    pytest.param("cuda_after", id="cuda_after", marks=pytest.mark.gpu),
]


def _pool_for(request: pytest.FixtureRequest, init_mode: str, world: int) -> RankPool:
    kind = "cpu" if init_mode == "cpu" else "gpu"
    name = f"{kind}_{'pair' if world == 2 else 'single'}"
    return request.getfixturevalue(name)


@pytest.mark.parametrize("init_mode", INIT_MODES)
@pytest.mark.parametrize(
    "offload_params, backward_prefetch, forward_prefetch",
    list(itertools.product([False, True], ["BACKWARD_POST", "BACKWARD_PRE"], [False, True])),
)
def test_main_wrap_api(
    request: pytest.FixtureRequest, offload_params: bool, backward_prefetch: str, forward_prefetch: bool, init_mode: str
) -> None:
    if init_mode == "cuda_after" and offload_params:
        pytest.skip("CPU offload with the model moved to CUDA after wrapping is unsupported (as in FSDP1)")
    pool = _pool_for(request, init_mode, world=2)
    cfg = {
        "offload_params": offload_params,
        "backward_prefetch": backward_prefetch,
        "forward_prefetch": forward_prefetch,
        "init_mode": init_mode,
    }
    outcome = pool.run(wrap_jobs.main_wrap_api, cfg)
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    for rank, result in enumerate(outcome.values):
        torch.testing.assert_close(result["losses"], result["ref_losses"], msg=lambda m: f"rank {rank}: {m}")
    assert outcome.values[0]["losses"] == outcome.values[1]["losses"]


@pytest.mark.parametrize(
    "init_mode, use_device_id",
    [
        pytest.param("cpu", False, id="cpu"),
        pytest.param("cuda_before", False, id="cuda_before", marks=pytest.mark.gpu),
        pytest.param("cuda_before", True, id="cuda_before-device_id", marks=pytest.mark.gpu),
        pytest.param("cuda_after", False, id="cuda_after", marks=pytest.mark.gpu),
        pytest.param("cuda_after", True, id="cuda_after-device_id", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("offload_params", [False, True])
def test_auto_wrap_smoke_test(
    request: pytest.FixtureRequest, init_mode: str, use_device_id: bool, offload_params: bool
) -> None:
    if init_mode == "cuda_after" and offload_params:
        pytest.skip("CPU offload with the model moved to CUDA after wrapping is unsupported (as in FSDP1)")
    pool = _pool_for(request, init_mode, world=1)
    cfg = {"init_mode": init_mode, "use_device_id": use_device_id, "offload_params": offload_params}
    outcome = pool.run(wrap_jobs.auto_wrap_smoke, cfg)
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    torch.testing.assert_close(outcome.values[0]["loss"], outcome.values[0]["ref_loss"])


@pytest.mark.parametrize("init_mode", [INIT_MODES[0], INIT_MODES[1]])
def test_mixed_precision_batchnorm_unit_runs_in_float32(request: pytest.FixtureRequest, init_mode: str) -> None:
    """Auto wrapping with mixed precision gives batch norm its own float32 unit (as FSDP1 does)."""
    pool = _pool_for(request, init_mode, world=2)
    outcome = pool.run(wrap_jobs.mixed_precision_batchnorm, {})
    assert outcome.status == "ok", outcome.reason + "\n" + "\n".join(e.traceback for e in outcome.errors.values())
    for result in outcome.values:
        assert result["units"] == ["Sequential", "Linear", "BatchNorm1d", "Linear"]
        assert result["bn_input"] == "torch.float32" and result["output"] == "torch.bfloat16"
        losses = result["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
