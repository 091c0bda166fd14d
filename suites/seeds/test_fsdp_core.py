"""Seed behaviours of torch's test_fsdp_core.py on our engine, 2 CPU ranks (gloo): parity with
DDP (nested, always-wrap nested, tied transformer, mixture of experts) over strategy x offload x
prefetch x use_orig_params, parameter change after init, pre-backward hook registration (also
after a state-dict round trip), eval output equals no_grad output, unsharded parameters are
Tensor views during compute even with prefetching.

The seed's delayed variants (GPU sleeps) are in suites/engine/test_gpu.py; its CUDA init modes
have no CPU meaning (the full product is in suites/engine/test_parity.py).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from engine import FSDP, BackwardPrefetch, CPUOffload, FlatParamHandle, MixedPrecision, ShardingStrategy
from engine.wrap import ModuleWrapPolicy, always_wrap_policy
from suites.engine import parity
from suites.engine.models import NestedWrapped, SharedTransformer
from suites.engine.ranks import session_tests

CPU = torch.device("cpu")
STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
PREFETCH = [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]


def _subtests():
    """Every strategy x offload, each with every prefetch x forward-prefetch x use_orig_params
    value at least once (a Latin square instead of the full product)."""
    for (strategy, offload), i in zip(itertools.product(STRATEGIES, [False, True]), itertools.count()):
        for j, (bwd, orig) in enumerate(itertools.product(PREFETCH, [False, True])):
            yield dict(
                sharding_strategy=strategy,
                cpu_offload=CPUOffload(offload),
                backward_prefetch=bwd,
                forward_prefetch=bool((i + j) % 2),
                use_orig_params=orig,
            )


def check_parity_nested_wrapped_model(rank: int, world_size: int) -> None:
    for kwargs in _subtests():
        parity.train_parity("nested", kwargs, CPU, reference="ddp")


def check_parity_nested_always_wrap_model(rank: int, world_size: int) -> None:
    for kwargs in _subtests():
        ref = DDP(NestedWrapped())
        model = FSDP(NestedWrapped(), auto_wrap_policy=always_wrap_policy, **kwargs)
        assert len(FSDP.fsdp_modules(model)) == 7
        opt, ref_opt = parity._optim(model.parameters()), parity._optim(ref.parameters())
        for step in range(4):
            x = NestedWrapped.input(step, rank, CPU)
            losses = []
            for m, o in ((model, opt), (ref, ref_opt)):
                loss = NestedWrapped.loss(m(*x))
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss)
            assert_close(losses[0], losses[1], msg=lambda msg: f"{kwargs} step {step}: {msg}")
        parity.assert_params_match(model, ref.module, f"always-wrap {kwargs}")


def check_parity_transformer(rank: int, world_size: int) -> None:
    for kwargs in _subtests():
        parity.train_parity("transformer", kwargs, CPU, reference="ddp")


def check_parity_mixture_of_experts(rank: int, world_size: int) -> None:
    for kwargs in _subtests():
        parity.train_parity("moe", kwargs, CPU)


def check_param_change_after_init(rank: int, world_size: int) -> None:
    for mp in (None, MixedPrecision()):
        x = SharedTransformer.input(0, rank, CPU)
        ref_out = SharedTransformer().wrap(FSDP, mixed_precision=mp)(*x)
        model = SharedTransformer().wrap(FSDP, mixed_precision=mp)
        nn.init.normal_(next(model.parameters()).data)
        assert not torch.allclose(model(*x), ref_out), "new output did not reflect the change after init"


def _check_pre_backward_hook_registration(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt.zero_grad()
    out = model(*SharedTransformer.input(0, dist.get_rank(), CPU))
    assert len(out._backward_hooks) == 1
    SharedTransformer.loss(out).backward()
    assert len(out._backward_hooks) == 1
    opt.step()
    assert len(out._backward_hooks) == 1


def check_pre_backward_hook_registration(rank: int, world_size: int) -> None:
    _check_pre_backward_hook_registration(SharedTransformer().wrap(FSDP))


def check_pre_backward_hook_registration_after_state_dict(rank: int, world_size: int) -> None:
    model = SharedTransformer().wrap(FSDP)
    opt = parity._optim(model.parameters())
    for step in range(2):
        SharedTransformer.loss(model(*SharedTransformer.input(step, rank, CPU))).backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(model.state_dict())
    _check_pre_backward_hook_registration(model)


def check_register_functions_called(rank: int, world_size: int) -> None:
    import engine.runtime as runtime

    model = SharedTransformer().wrap(FSDP)
    calls = {"pre_backward_registered": 0}
    orig_post_forward = runtime.post_forward

    def counting_post_forward(state, output):
        out = orig_post_forward(state, output)
        calls["pre_backward_registered"] += sum(
            len(t._backward_hooks or {}) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        return out

    with mock.patch.object(runtime, "post_forward", counting_post_forward):
        model(*SharedTransformer.input(0, rank, CPU))
    assert calls["pre_backward_registered"] > 0
    units = [m._unit for m in FSDP.fsdp_modules(model) if m._unit is not None]
    assert units and all(u._post_backward_hook is not None for u in units), "post-backward hooks registered"


def check_transformer_eval_equals_no_grad(rank: int, world_size: int) -> None:
    # bfloat16 stands in for the seed's float16 (CPU kernels).
    for mp in (None, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)):
        model = SharedTransformer().wrap(FSDP, mixed_precision=mp)
        opt = parity._optim(model.parameters())
        SharedTransformer.loss(model(*SharedTransformer.input(0, rank, CPU))).backward()
        opt.step()
        x = SharedTransformer.input(1, rank, CPU)
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
def _assert_tensor_views() -> Iterator[None]:
    orig = FlatParamHandle._use_unsharded_views

    def as_tensors_only(self: FlatParamHandle, as_params: bool) -> None:
        assert not as_params, "Expects to use Tensor views but using parameter views"
        return orig(self, as_params)

    with mock.patch.object(FlatParamHandle, "_use_unsharded_views", as_tensors_only):
        yield


def check_unshard_params_as_tensors(rank: int, world_size: int) -> None:
    combos = itertools.product(
        [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP], [False, True], [False, True], PREFETCH
    )
    for strategy, orig, fwd, bwd in combos:
        model = FSDP(
            nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)]),
            sharding_strategy=strategy,
            use_orig_params=orig,
            forward_prefetch=fwd,
            backward_prefetch=bwd,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        )
        assert len(FSDP.fsdp_modules(model)) == 6
        seen: list[type] = []

        def record(module: nn.Module, args: tuple) -> None:
            seen.append(type(module.weight))

        handles = [lin.register_forward_pre_hook(record) for lin in model.module if isinstance(lin, FSDP) for lin in [lin.module]]
        for _ in range(3):
            with _assert_tensor_views():
                model(torch.randn(2, 3)).sum().backward()
        for h in handles:
            h.remove()
        assert seen and all(t is torch.Tensor for t in seen), f"{strategy} orig={orig}: {set(seen)}"


CHECKS = [
    check_parity_nested_wrapped_model,
    check_parity_nested_always_wrap_model,
    check_parity_transformer,
    check_parity_mixture_of_experts,
    check_param_change_after_init,
    check_pre_backward_hook_registration,
    check_pre_backward_hook_registration_after_state_dict,
    check_register_functions_called,
    check_transformer_eval_equals_no_grad,
    check_unshard_params_as_tensors,
]
session, test_check = session_tests(CHECKS, timeout_s=400)
