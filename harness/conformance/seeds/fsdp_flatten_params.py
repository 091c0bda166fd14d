"""Behaviours of torch's test_fsdp_flatten_params.py that need the runtime (the layout and
metadata ones live in suites/flat_param), as conformance checks run against every engine with torch
FSDP1's API (``fsdp_api``: our engine and torch FSDP1): partial flattening, flattening nothing, an
empty module, numel, forward output and the parameter norm after a step with shared parameters, each
in full and half precision, on CPU with a one-rank gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from harness.conformance.flat_handles import flatten_params_transformer
from harness.conformance.fsdp1_checks import FSDPApi, load_api
from harness.pytest_plugin.rank_checks import api_rank_check_tests

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["rank_checks", "test_check"]

CPU = torch.device("cpu")


def _input(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Seeded right before forward so dropout draws the same masks in both runs.
    torch.manual_seed(1)
    return torch.rand(6, 3, 16, dtype=dtype), torch.rand(4, 3, 16, dtype=dtype)


def _output(module: nn.Module) -> torch.Tensor:
    dtype = next(module.parameters()).dtype
    return module(*_input(dtype))


def _handle_kwargs(api: FSDPApi) -> dict:
    return dict(
        device=CPU,
        sharding_strategy=api.HandleShardingStrategy.FULL_SHARD,
        offload_params=False,
        mp_param_dtype=None,
        mp_reduce_dtype=None,
        keep_low_precision_grads=False,
        process_group=dist.group.WORLD,
        use_orig_params=False,
        fsdp_extension=None,
    )


def check_partial_flattening(api: FSDPApi, rank: int, world_size: int) -> None:
    for half in (False, True):
        module = flatten_params_transformer()
        if half:
            module = module.half()
        numel = sum(p.numel() for p in module.parameters())
        enc1 = list(module.encoder.layers[1].parameters())
        dec0 = list(module.decoder.layers[0].parameters())
        module.encoder.layers[1] = api.wrap(module.encoder.layers[1])
        module.decoder.layers[0] = api.wrap(module.decoder.layers[0])
        flat_params = [module.encoder.layers[1]._flat_param, module.decoder.layers[0]._flat_param]
        assert sum(fp.numel() for fp in flat_params) == sum(p.numel() for p in enc1 + dec0)
        assert sum(p.numel() for p in module.parameters()) == numel
        assert len(list(module.encoder.layers[1].parameters())) == 1
        assert len(list(module.decoder.layers[0].parameters())) == 1
        assert len(list(module.encoder.layers[0].parameters())) == len(enc1)
        assert len(list(module.decoder.layers[1].parameters())) == len(dec0)
        orig_dtype = enc1[0].dtype
        new_dtype = torch.float32 if orig_dtype == torch.float16 else torch.float16
        assert all(fp.dtype == orig_dtype for fp in flat_params)
        module = module.to(dtype=new_dtype)
        assert all(fp.dtype == new_dtype for fp in flat_params), "module.to() reaches the flat parameters"
        assert all(p.dtype == new_dtype for p in module.encoder.layers[0].parameters())


def check_flatten_nothing(api: FSDPApi, rank: int, world_size: int) -> None:
    for half in (False, True):
        module = flatten_params_transformer().to(torch.float16 if half else torch.float32)
        try:
            api.FlatParamHandle([], module, **_handle_kwargs(api))
        except ValueError as e:
            assert "Cannot construct a FlatParamHandle with an empty parameter list" in str(e)
        else:
            raise AssertionError("flattening nothing must raise ValueError")


def check_empty_module(api: FSDPApi, rank: int, world_size: int) -> None:
    class Empty(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    x = torch.rand(1)
    fsdp = api.wrap(Empty())
    assert len(list(fsdp.parameters())) == 0
    assert fsdp._flat_param is None
    assert_close(fsdp(x), x + 1)


def check_numel(api: FSDPApi, rank: int, world_size: int) -> None:
    for shared in (False, True):
        for half in (False, True):
            module = flatten_params_transformer(shared=shared).to(torch.float16 if half else torch.float32)
            ref_numel = sum(p.numel() for p in module.parameters())
            handle = api.FlatParamHandle(list(module.parameters()), module, **_handle_kwargs(api))
            assert handle.flat_param.numel() == ref_numel, (shared, half)


def check_output(api: FSDPApi, rank: int, world_size: int) -> None:
    for shared in (False, True):
        for half in (False, True):
            module = flatten_params_transformer(shared=shared).to(torch.float16 if half else torch.float32)
            ref = _output(module)
            out = _output(api.wrap(module))
            assert_close(out, ref, msg=lambda m: f"shared={shared} half={half}: {m}")


def _pnorm_after_step(module: nn.Module) -> torch.Tensor:
    optim = torch.optim.SGD(module.parameters(), lr=0.01)
    _output(module).sum().backward()
    optim.step()
    return torch.norm(torch.stack([p.detach().float().norm() for p in module.parameters()]))


def check_pnorm_after_step_with_shared_params(api: FSDPApi, rank: int, world_size: int) -> None:
    for half in (False, True):
        ref_module = flatten_params_transformer(shared=True).to(torch.float16 if half else torch.float32)
        ref = _pnorm_after_step(ref_module)
        module = flatten_params_transformer(shared=True).to(torch.float16 if half else torch.float32)
        got = _pnorm_after_step(api.wrap(module))
        assert_close(got, ref, msg=lambda m: f"half={half}: {m}")


CHECKS = [
    check_partial_flattening,
    check_flatten_nothing,
    check_empty_module,
    check_numel,
    check_output,
    check_pnorm_after_step_with_shared_params,
]
rank_checks, test_check = api_rank_check_tests(CHECKS, load_api, world_size=1)
