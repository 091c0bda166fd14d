"""Rank jobs on which modules compute in which precision: batch norms as their own full-precision
units (and ResNet-50 on GPUs), ignored modules, one submodule in low precision, external inputs."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from harness.cases.dtypes import dtype_of
from harness.conformance.mixed_precision.models import BatchNormNet, ModelWithIgnoredModule, SaveForwardInputsModel
from harness.conformance.mixed_precision.rank_api import device_kwargs, engine_api
from harness.ranks.rank import RankContext


# ---------------------------------------------------------------------------- batch norm
def _never_wrap(*args: Any, **kwargs: Any) -> bool:
    return False


def mp_batchnorm(ctx: RankContext, payload: dict[str, Any]) -> None:
    """``_module_classes_to_ignore`` modules become separate full-precision units, with the warning,
    and forward/backward run (``forward=False`` checks the wrapping only: SyncBatchNorm computes
    only on GPUs)."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
    torch.manual_seed(0)
    net = BatchNormNet().to(ctx.device)
    if payload["convert_sync_bn"]:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    mp = api.MixedPrecision(
        param_dtype=low, reduce_dtype=low, buffer_dtype=low, _module_classes_to_ignore=[_BatchNorm, nn.LayerNorm]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = api.wrap(net, mixed_precision=mp, auto_wrap_policy=_never_wrap, **device_kwargs(ctx))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("These modules will be wrapped as separate FSDP" in m for m in messages), messages
    for mod in (model.ln, model.bn):
        assert isinstance(mod, api.FSDP), type(mod)
        assert mod.mixed_precision == api.MixedPrecision(), mod.mixed_precision
    for mod in (model.fc1, model.fc2, model.fc3):
        assert not isinstance(mod, api.FSDP), type(mod)
    assert model.mixed_precision == mp
    if not payload.get("forward", True):
        return
    out = model(torch.randn((1, 2), device=ctx.device))
    out.sum().backward()
    assert out.dtype == low, out.dtype
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, f"batch-norm buffer {name} is {buf.dtype}: its unit has no mixed precision"


def resnet50(ctx: RankContext, payload: dict[str, Any]) -> int:
    """ResNet-50 with SyncBatchNorm, size-based auto wrapping and fp16: every batch norm is its own
    full-precision unit and forward/backward run (without that, dtypes would mismatch)."""
    import torchvision

    api = engine_api(payload)
    model = torchvision.models.resnet50().to(ctx.device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=ctx.world_group())
    n_bn = sum(isinstance(m, _BatchNorm) for m in model.modules())
    mp = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fsdp = api.wrap(model, auto_wrap_policy=api.policy("size_based_auto_wrap_policy"), mixed_precision=mp)
    fsdp_bn = sum(isinstance(m.module, _BatchNorm) for m in api.FSDP.fsdp_modules(fsdp))
    assert fsdp_bn == n_bn, (fsdp_bn, n_bn)
    size = payload.get("size", 1000)
    loss = fsdp(torch.ones(1, 3, size, size, device=ctx.device)).sum()
    loss.backward()
    return n_bn


# ---------------------------------------------------------------------------- ignored modules
def ignored_modules(ctx: RankContext, payload: dict[str, Any]) -> None:
    """Parameters (and buffers) of ignored modules keep their dtype: feeding them low-precision
    activations raises; casting around them works."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
    mp = api.MixedPrecision(param_dtype=low, buffer_dtype=low)
    torch.manual_seed(0)
    model = ModelWithIgnoredModule().to(ctx.device)
    fsdp = api.wrap(model, ignored_modules=[model.ignored], mixed_precision=mp, **device_kwargs(ctx))
    x = torch.ones(2, 32, device=ctx.device)
    try:
        fsdp(x).sum().backward()
    except RuntimeError as e:
        assert "must have the same dtype" in str(e), str(e)
    else:
        raise AssertionError("low-precision activations into an ignored float32 module did not raise")
    assert all(p.dtype == torch.float32 for p in model.ignored.parameters())

    torch.manual_seed(0)
    model = ModelWithIgnoredModule(cast_for_ignored=True).to(ctx.device)
    fsdp = api.wrap(model, ignored_modules=[model.ignored], mixed_precision=mp, **device_kwargs(ctx))
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    for _ in range(2):
        out = fsdp(x)
        assert out.dtype == low, out.dtype
        out.float().sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
    for name, p in model.ignored.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, (name, p.dtype)
    assert model.ignored.scale.dtype == torch.float32, model.ignored.scale.dtype
    managed = {n: b.dtype for n, b in fsdp.named_buffers() if ".ignored." not in n}
    assert managed and set(managed.values()) == {low}, managed


# ---------------------------------------------------------------------------- per-submodule precision
def submodule_precision(ctx: RankContext, payload: dict[str, Any]) -> dict[str, str]:
    """One submodule in low precision inside a full-precision model: the working layouts record
    the expected input dtypes; the raising ones raise "must have the same dtype"."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
    f32 = torch.float32
    results: dict[str, str] = {}

    def layout(name: str, model_cast: bool, child_mp: Any, root_mp: Any, child: str) -> tuple | None:
        inputs: dict[Any, Tensor] = {}
        torch.manual_seed(0)
        model = SaveForwardInputsModel(inputs, cast_forward_inputs=model_cast).to(ctx.device)
        c1, c2 = model.c1, model.c2
        setattr(model, child, api.wrap(getattr(model, child), mixed_precision=child_mp, **device_kwargs(ctx)))
        fsdp = api.wrap(model, mixed_precision=root_mp, **device_kwargs(ctx))
        x = torch.zeros(2, 16, device=ctx.device)
        try:
            fsdp(x).sum().backward()
        except RuntimeError as e:
            if "must have the same dtype" not in str(e):
                raise
            results[name] = "raised"
            return None
        got = (inputs[model].dtype, inputs[c1].dtype, inputs[c2].dtype)
        results[name] = str(got)
        return got

    cast_low = api.MixedPrecision(param_dtype=low, cast_forward_inputs=True)
    no_cast_low = api.MixedPrecision(param_dtype=low, cast_forward_inputs=False)
    cast_f32 = api.MixedPrecision(param_dtype=f32, cast_forward_inputs=True)
    assert layout("low_on_c2", False, cast_low, None, "c2") == (f32, f32, low), results
    assert layout("low_on_c2_module_casts", True, no_cast_low, None, "c2") == (f32, f32, f32), results
    assert layout("low_on_c2_no_cast", False, no_cast_low, None, "c2") is None, results
    assert layout("low_on_c1_under_f32_root", False, cast_low, cast_f32, "c1") is None, results
    assert layout("low_on_c2_under_f32_root", False, cast_low, cast_f32, "c2") == (f32, f32, low), results
    return results


def submodule_external_inputs(ctx: RankContext, payload: dict[str, Any]) -> None:
    """Root inputs are cast; a tensor a submodule receives from elsewhere is not."""
    api = engine_api(payload)
    low = dtype_of(payload.get("low", "float16"))
    seen: dict[str, Tensor] = {}

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(16, 16)

        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            seen["l2_input_x"], seen["l2_input_y"] = x, y
            return self.l(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(16, 16)
            self.l2 = Inner()

        def forward(self, x: Tensor) -> Tensor:
            seen["model_input_x"] = x
            y = torch.ones(2, 16, device=x.device, dtype=torch.float32)
            return self.l2(self.l1(x), y)

    mp = api.MixedPrecision(param_dtype=low)
    model = Outer().to(ctx.device)
    model.l2 = api.wrap(model.l2, mixed_precision=mp, **device_kwargs(ctx))
    fsdp = api.wrap(model, mixed_precision=mp, **device_kwargs(ctx))
    fsdp(torch.zeros(2, 16, device=ctx.device)).sum().backward()
    got = {k: v.dtype for k, v in seen.items()}
    assert got == {"model_input_x": low, "l2_input_x": low, "l2_input_y": torch.float32}, got
