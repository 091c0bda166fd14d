"""Behaviours of torch's test_fsdp_core.py, as conformance checks run against every engine with
torch FSDP1's API (``fsdp_api``: our engine and torch FSDP1), 2 ranks on the CPU and again on the GPUs
(gloo ranks sharing one where there are fewer GPUs than ranks): parity with DDP
(nested, always-wrap nested, tied transformer, mixture of experts) over strategy x prefetch x
use_orig_params, with and without CPU offload, parameter change after init, pre-backward hook
registration (also after a state-dict round trip), eval output equals no_grad output, unsharded
parameters are Tensor views during compute even with prefetching. The parity checks are harness cases
(``harness.conformance.seeds.seed_parity``); the others run here as rank checks, one spawn of the ranks per engine and device.

The ported test's delayed variants (GPU sleeps, our engine, the parity checks' whole product, the mixture of
experts included) are in suites/engine/test_gpu.py; its CUDA init modes have no CPU meaning: the parity
checks run them on CUDA ranks (``seed_parity``), the hook checks build the model both ways on every device.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from harness.cases.model_protocol import to_device, wrap_bottom_up
from harness.conformance.engine_models import NestedWrapped, SharedTransformer
from harness.conformance.fsdp1_checks import FSDPApi, load_api, optim
from harness.pytest_plugin.rank_checks import api_rank_check_tests
from harness.engines.optim import sgd
from harness.ranks.rank import rank_device

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["rank_checks", "test_check"]


def _prefetches(api: FSDPApi) -> list:
    return [None, api.BackwardPrefetch.BACKWARD_PRE, api.BackwardPrefetch.BACKWARD_POST]


def check_always_wrap_policy_wraps_every_submodule(api: FSDPApi, rank: int, world_size: int) -> None:
    """``always_wrap_policy`` makes a unit of every submodule: the units the always-wrap parity cases
    (``engine_always_wrap``) wrap by hand."""
    model = api.wrap(NestedWrapped(rank_device()), auto_wrap_policy=api.policy("always_wrap_policy"))
    assert len(api.FSDP.fsdp_modules(model)) == 7


def check_param_change_after_init(api: FSDPApi, rank: int, world_size: int) -> None:
    device = rank_device()
    for mp in (None, api.MixedPrecision()):
        x = to_device(SharedTransformer.get_input(step=0, rank=rank), device)
        ref_out = wrap_bottom_up(SharedTransformer(device), api.wrap, mixed_precision=mp)(*x)
        model = wrap_bottom_up(SharedTransformer(device), api.wrap, mixed_precision=mp)
        nn.init.normal_(next(model.parameters()).data)
        assert not torch.allclose(model(*x), ref_out), "new output did not reflect the change after init"


def _check_pre_backward_hook_registration(model: nn.Module) -> None:
    opt = sgd(model.parameters(), lr=0.01, momentum=0.9)
    opt.zero_grad()
    inputs = to_device(SharedTransformer.get_input(step=0, rank=dist.get_rank()), rank_device())
    out = model(*inputs)
    assert len(out._backward_hooks) == 1
    SharedTransformer.get_loss(inputs, out).backward()
    assert len(out._backward_hooks) == 1
    opt.step()
    assert len(out._backward_hooks) == 1


def _transformer(api: FSDPApi, cuda_first: bool, **kwargs: Any) -> nn.Module:
    """The ported test's recursively wrapped transformer: built on the rank's device and wrapped (its
    ``CUDA_BEFORE``, ``cuda_first``), or built on the CPU, wrapped there and moved after (``CUDA_AFTER``).
    On CPU ranks the two are the same model."""
    device = rank_device()
    model = wrap_bottom_up(SharedTransformer(device if cuda_first else "cpu"), api.wrap, **kwargs)
    return model if cuda_first else model.to(device)


def check_pre_backward_hook_registration(api: FSDPApi, rank: int, world_size: int) -> None:
    for cuda_first in (False, True):
        _check_pre_backward_hook_registration(_transformer(api, cuda_first))


def check_pre_backward_hook_registration_after_state_dict(api: FSDPApi, rank: int, world_size: int) -> None:
    model = wrap_bottom_up(SharedTransformer(rank_device()), api.wrap)
    opt = optim(model.parameters())
    for step in range(2):
        inputs = to_device(SharedTransformer.get_input(step=step, rank=rank), rank_device())
        SharedTransformer.get_loss(inputs, model(*inputs)).backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(model.state_dict())
    _check_pre_backward_hook_registration(model)


def _hooks_registered_builtin(api: FSDPApi, rank: int, model: nn.Module) -> None:
    """Our engine registers the pre-backward hooks on the outputs in ``ModuleState.post_forward`` and
    keeps each unit's post-backward hook handle on the unit."""
    from engine.state import ModuleState

    calls = {"pre_backward_registered": 0}
    orig_post_forward = ModuleState.post_forward

    def counting_post_forward(state, output):
        out = orig_post_forward(state, output)
        calls["pre_backward_registered"] += sum(
            len(t._backward_hooks or {}) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        return out

    with mock.patch.object(ModuleState, "post_forward", counting_post_forward):
        model(*to_device(SharedTransformer.get_input(step=0, rank=rank), rank_device()))
    assert calls["pre_backward_registered"] > 0
    units = [m._unit for m in api.FSDP.fsdp_modules(model) if m._unit is not None]
    assert units and all(u._post_backward_hook is not None for u in units), "post-backward hooks registered"


def _hooks_registered_torch(api: FSDPApi, rank: int, model: nn.Module) -> None:
    """torch FSDP1 registers them in ``_runtime_utils`` (as the ported test checks it, by patching)."""
    import torch.distributed.fsdp._runtime_utils as runtime_utils

    with mock.patch.object(
        runtime_utils, "_register_pre_backward_hooks", wraps=runtime_utils._register_pre_backward_hooks
    ) as pre, mock.patch.object(
        runtime_utils, "_register_post_backward_hook", wraps=runtime_utils._register_post_backward_hook
    ) as post:
        model(*to_device(SharedTransformer.get_input(step=0, rank=rank), rank_device()))
    assert pre.call_count > 0, "pre-backward hooks registered"
    assert post.call_count > 0, "post-backward hooks registered"


def check_register_functions_called(api: FSDPApi, rank: int, world_size: int) -> None:
    """The ported test's product: built before or after the move to the device, with and without (default)
    mixed precision."""
    # The functions that register the hooks are internals, named differently in each engine.
    registered = _hooks_registered_torch if api.is_torch else _hooks_registered_builtin
    for cuda_first, mp in itertools.product((False, True), (None, api.MixedPrecision())):
        registered(api, rank, _transformer(api, cuda_first, mixed_precision=mp))


def check_transformer_eval_equals_no_grad(api: FSDPApi, rank: int, world_size: int) -> None:
    # bfloat16 stands in for the ported test's float16 (CPU kernels).
    bf16 = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    device = rank_device()
    for mp in (None, bf16):
        model = wrap_bottom_up(SharedTransformer(device), api.wrap, mixed_precision=mp)
        opt = optim(model.parameters())
        inputs = to_device(SharedTransformer.get_input(step=0, rank=rank), device)
        SharedTransformer.get_loss(inputs, model(*inputs)).backward()
        opt.step()
        x = to_device(SharedTransformer.get_input(step=1, rank=rank), device)
        model.eval()
        # Under no_grad, eval-mode encoder layers take torch's fused "fast path", whose
        # bfloat16 rounding differs from the composite path: compare the same kernels.
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            ref_out = model(*x)
            with torch.no_grad():
                no_grad_out = model(*x)
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)
        assert_close(ref_out, no_grad_out)


@contextlib.contextmanager
def _assert_tensor_views(api: FSDPApi) -> Iterator[None]:
    handle_cls = api.FlatParamHandle
    orig = handle_cls._use_unsharded_views

    def as_tensors_only(self, as_params: bool) -> None:
        assert not as_params, "Expects to use Tensor views but using parameter views"
        return orig(self, as_params)

    with mock.patch.object(handle_cls, "_use_unsharded_views", as_tensors_only):
        yield


def check_unshard_params_as_tensors(api: FSDPApi, rank: int, world_size: int) -> None:
    combos = itertools.product(
        [api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP], [False, True], [False, True], _prefetches(api)
    )
    for strategy, orig, fwd, bwd in combos:
        model = api.wrap(
            nn.Sequential(*[nn.Linear(3, 3, device=rank_device()) for _ in range(5)]),
            sharding_strategy=strategy,
            use_orig_params=orig,
            forward_prefetch=fwd,
            backward_prefetch=bwd,
            auto_wrap_policy=api.policy("ModuleWrapPolicy")({nn.Linear}),
        )
        assert len(api.FSDP.fsdp_modules(model)) == 6
        seen: list[type] = []

        def record(module: nn.Module, args: tuple) -> None:
            seen.append(type(module.weight))

        handles = [
            unit.module.register_forward_pre_hook(record) for unit in model.module if isinstance(unit, api.FSDP)
        ]
        for _ in range(3):
            with _assert_tensor_views(api):
                model(torch.randn(2, 3, device=rank_device())).sum().backward()
        for h in handles:
            h.remove()
        assert seen and all(t is torch.Tensor for t in seen), f"{strategy} orig={orig}: {set(seen)}"


CHECKS = [
    check_always_wrap_policy_wraps_every_submodule,
    check_param_change_after_init,
    check_pre_backward_hook_registration,
    check_pre_backward_hook_registration_after_state_dict,
    check_register_functions_called,
    check_transformer_eval_equals_no_grad,
    check_unshard_params_as_tensors,
]
rank_checks, test_check = api_rank_check_tests(CHECKS, load_api, device=("cpu", "cuda"), timeout_s=400)
