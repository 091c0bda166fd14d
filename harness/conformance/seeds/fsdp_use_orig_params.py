"""Behaviours of torch's test_fsdp_use_orig_params.py, as conformance checks run against every
engine with torch FSDP1's API (``fsdp_api``: our engine and torch FSDP1), 2 ranks on the CPU and on the GPUs:
parameter groups with different hyperparameters (with and without CPU offload), different
trainability, multiple optimizers,
multiple forwards before backward, summon between two forwards, access after forward, parameter
and gradient writeback (and shape mismatch), no-reshard changes between forward and backward,
FQNs in forward, no_sync correctness and mixed-precision dtypes, non-uniform requires_grad.

DDP is the reference where the ported test uses it; no_sync against the all-data reference is harness cases
(``seed_parity``). The training against DDP (parameter groups, trainability, multiple optimizers,
compile) is ``orig_params_ddp``'s. The CI tier runs a representative part of the ported test's
test_diff_hyperparams (6 subtests that show every value of every axis) and of its test_fsdp_compile
(FULL_SHARD, 3 iterations); the slow tier (``--matrix pairwise|full``, ``SLOW_CHECKS``) runs their whole
products, 10 iterations each, with the ported test's init modes on CUDA ranks and inductor there.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from harness.cases.model_protocol import wrap_bottom_up
from harness.conformance.engine_models import SharedTransformer
from harness.conformance.fsdp1_checks import FSDPApi, clean as _clean, load_api
from harness.pytest_plugin.rank_checks import api_rank_check_tests
from harness.conformance.seeds.orig_params_ddp import (
    HYPERPARAM_AXES,
    _check_param_parity,
    _input,
    _linear_policy,
    _strategies,
    check_diff_hyperparams,
    check_diff_hyperparams_cpu_offload,
    check_diff_hyperparams_cpu_offload_every_subtest,
    check_diff_hyperparams_every_subtest,
    check_diff_trainability,
    check_fsdp_compile,
    check_fsdp_compile_every_subtest,
    check_multiple_optimizers,
    hyperparam_subtests,
)
from harness.engines.optim import sgd
from harness.ranks.rank import rank_device

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["rank_checks", "test_check",
           "test_hyperparam_subtests_are_the_torch_tests_product_and_smoke_shows_every_value"]


def _orig_and_flat_models(api: FSDPApi, strategy: Any, offload: bool):
    models = []
    for orig in (False, True):
        model = wrap_bottom_up(SharedTransformer(rank_device()), 
            api.wrap, sharding_strategy=strategy, cpu_offload=api.CPUOffload(offload), use_orig_params=orig
        )
        models.append((model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)))
    return models


def _fsdp_params_equal(api: FSDPApi, a: nn.Module, b: nn.Module) -> None:
    with api.FSDP.summon_full_params(a), api.FSDP.summon_full_params(b):
        for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
            assert n1 == n2
            assert_close(p1, p2)


def _multiple_forward(api: FSDPApi, offload: bool) -> None:
    api.require_offload(offload)
    rank = dist.get_rank()
    for strategy in _strategies(api):
        (m1, o1), (m2, o2) = _orig_and_flat_models(api, strategy, offload)
        for i in range(3):
            inp1 = _input(i, rank)
            inp2 = _input(i + 100, rank)
            results = []
            for model, opt in ((m1, o1), (m2, o2)):
                opt.zero_grad()
                l1, l2 = SharedTransformer.get_loss(inp1, model(*inp1)), SharedTransformer.get_loss(inp2, model(*inp2))
                (l1 + l2).backward()
                opt.step()
                results.append((l1, l2))
            assert_close(results[0], results[1], msg=lambda m: f"{strategy} offload={offload}: {m}")
        _fsdp_params_equal(api, m1, m2)


def check_multiple_forward(api: FSDPApi, rank: int, world_size: int) -> None:
    _multiple_forward(api, offload=False)


def check_multiple_forward_cpu_offload(api: FSDPApi, rank: int, world_size: int) -> None:
    _multiple_forward(api, offload=True)


def _summon_between_two_forwards(api: FSDPApi, offload: bool) -> None:
    api.require_offload(offload)
    rank = dist.get_rank()
    for strategy in _strategies(api):
        (m1, o1), (m2, o2) = _orig_and_flat_models(api, strategy, offload)
        for i in range(3):
            o1.zero_grad()
            o2.zero_grad()
            inp1 = _input(i, rank)
            a1, b1 = SharedTransformer.get_loss(inp1, m1(*inp1)), SharedTransformer.get_loss(inp1, m2(*inp1))
            assert_close(a1, b1)
            _fsdp_params_equal(api, m1, m2)
            inp2 = _input(i + 100, rank)
            a2, b2 = SharedTransformer.get_loss(inp2, m1(*inp2)), SharedTransformer.get_loss(inp2, m2(*inp2))
            assert_close(a2, b2)
            (a1 + a2).backward()
            (b1 + b2).backward()
            o1.step()
            o2.step()
        _fsdp_params_equal(api, m1, m2)


def check_summon_between_two_forwards(api: FSDPApi, rank: int, world_size: int) -> None:
    _summon_between_two_forwards(api, offload=False)


def check_summon_between_two_forwards_cpu_offload(api: FSDPApi, rank: int, world_size: int) -> None:
    _summon_between_two_forwards(api, offload=True)


class _Lin2(nn.Module):
    """The ported test's writeback model: Linear(5, 5) -> ReLU -> Linear(5, 7)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5, device=rank_device())
        self.lin2 = nn.Linear(5, 7, device=rank_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))

    def get_input(self) -> tuple[torch.Tensor, ...]:
        return (torch.randn((2, 5)).to(rank_device()),)


def check_access_params_after_forward(api: FSDPApi, rank: int, world_size: int) -> None:
    for strategy in _strategies(api):
        ref = _Lin2()
        model = api.wrap(_Lin2(), sharding_strategy=strategy, auto_wrap_policy=_linear_policy(api), use_orig_params=True)
        x = model.get_input()
        model(*x)
        for name in ("weight", "bias"):
            p = getattr(model.module.lin1, name)
            full = getattr(ref.lin1, name).detach().reshape(-1)
            if strategy == api.ShardingStrategy.FULL_SHARD:
                # Resharded: the sharded, flattened original parameter.
                start = rank * p.numel() if rank == 0 else full.numel() - p.numel()
                assert p.dim() == 1 and p.numel() <= full.numel()
                assert_close(p.detach(), full[start : start + p.numel()] if rank == 0 else full[full.numel() - p.numel() :])
            else:
                # Not resharded: the unsharded view used by forward.
                assert_close(p.detach(), getattr(ref.lin1, name).detach())


def check_param_writeback(api: FSDPApi, rank: int, world_size: int) -> None:
    def transform(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(torch.ones_like(p) * 2)

    for first, change_data in itertools.product([True, False], [True, False]):
        ddp = DDP(_Lin2())
        fsdp = api.wrap(_Lin2(), use_orig_params=True)
        for m in (ddp.module, fsdp.module):
            lin = m.lin1 if first else m.lin2
            if change_data:
                lin.weight.data = transform(lin.weight)
            else:
                lin.weight = transform(lin.weight)
        _check_param_parity(api, ddp, fsdp)


def check_grad_writeback(api: FSDPApi, rank: int, world_size: int) -> None:
    for first, change_data, set_to_none in itertools.product([False, True], [False, True], [False, True]):
        if change_data and set_to_none:
            continue

        def transform(p: nn.Parameter) -> torch.Tensor | None:
            return None if set_to_none else torch.ones_like(p) * 2

        ddp = DDP(_Lin2())
        fsdp = api.wrap(_Lin2(), use_orig_params=True)
        ddp_opt = sgd(ddp.parameters(), lr=1e-2, momentum=0.9)
        fsdp_opt = sgd(fsdp.parameters(), lr=1e-2, momentum=0.9)
        for step in range(2):
            torch.manual_seed(step + 10 * rank)
            x = fsdp.get_input()
            ddp(*x).sum().backward()
            fsdp(*x).sum().backward()
            if step == 0:
                for m in (ddp.module, fsdp.module):
                    w = (m.lin1 if first else m.lin2).weight
                    if change_data:
                        if w.grad is not None:
                            w.grad.data = transform(w)
                    else:
                        w.grad = transform(w)
            ddp_opt.step()
            fsdp_opt.step()
            _check_param_parity(api, ddp, fsdp)
            # Gradients deliberately not zeroed: the next backward accumulates onto the writeback.


def check_writeback_shape_mismatch(api: FSDPApi, rank: int, world_size: int) -> None:
    fsdp = api.wrap(_Lin2(), use_orig_params=True)
    lin = fsdp.module.lin1 if rank == 0 else fsdp.module.lin2
    shape = [d + 1 for d in lin.weight.shape]
    lin.weight = nn.Parameter(torch.randn(shape, device=rank_device()))
    lin.weight.grad = torch.randn(shape, device=rank_device())
    with pytest.raises(RuntimeError, match="Cannot writeback when the parameter shape changes"):
        with api.FSDP.summon_full_params(fsdp):
            pass
    fsdp = api.wrap(_Lin2(), use_orig_params=True)
    lin = fsdp.module.lin1 if rank == 0 else fsdp.module.lin2
    # ``.grad =`` itself refuses another shape; ``.grad.data`` does not.
    lin.weight.grad = torch.zeros_like(lin.weight)
    lin.weight.grad.data = torch.randn([d + 1 for d in lin.weight.shape], device=rank_device())
    with pytest.raises(RuntimeError, match="Cannot writeback when the gradient shape changes"):
        with api.FSDP.summon_full_params(fsdp):
            pass


def check_writeback_between_fwd_and_bwd_for_no_reshard_raises(api: FSDPApi, rank: int, world_size: int) -> None:
    kwargs = dict(sharding_strategy=api.ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=_linear_policy(api), use_orig_params=True)
    msg = "FSDP does not support changing the parameters between forward and backward"
    fsdp = api.wrap(_Lin2(), **kwargs)
    loss = fsdp(*fsdp.get_input()).sum()
    fsdp.lin1.weight.data = fsdp.lin1.weight.clone()
    with pytest.raises(AssertionError, match=msg):
        loss.backward()
    fsdp = api.wrap(_Lin2(), **kwargs)
    loss = fsdp(*fsdp.get_input()).sum()
    fsdp.lin1._fsdp_wrapped_module.weight = nn.Parameter(fsdp.lin1.weight.clone())
    with pytest.raises(AssertionError, match=msg):
        loss.backward()
    # FSDP_SKIP_WRITEBACK_CHECK=1 turns the check off.
    os.environ["FSDP_SKIP_WRITEBACK_CHECK"] = "1"
    try:
        fsdp = api.wrap(_Lin2(), **kwargs)
        loss = fsdp(*fsdp.get_input()).sum()
        fsdp.lin1.weight.data = fsdp.lin1.weight.clone()
        loss.backward()
    finally:
        os.environ.pop("FSDP_SKIP_WRITEBACK_CHECK")


def _no_reshard_and_mixed_precision(api: FSDPApi, full_prec_in_eval: bool) -> None:
    """Compute runs in bf16 in train, and in eval unless ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read when the
    units are built); summoned parameters are in full precision, whatever the order of train/eval switches
    and summons without resharding after forward, and no writeback is falsely triggered."""
    if full_prec_in_eval:
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        fsdp = api.wrap(
            _Lin2(),
            sharding_strategy=api.ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=_linear_policy(api),
            mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16),
            use_orig_params=True,
        )
    finally:
        os.environ.pop("FSDP_USE_FULL_PREC_IN_EVAL", None)
    eval_dtype = torch.float32 if full_prec_in_eval else torch.bfloat16
    x = fsdp.get_input()
    assert fsdp(*x).dtype == torch.bfloat16
    with api.FSDP.summon_full_params(fsdp):
        assert {p.dtype for p in fsdp.parameters()} == {torch.float32}
    fsdp.train()
    assert fsdp(*x).dtype == torch.bfloat16
    fsdp.eval()
    assert fsdp(*x).dtype == eval_dtype
    fsdp.train()
    loss = fsdp(*x).sum()
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    fsdp.eval()
    assert fsdp(*x).dtype == eval_dtype
    with api.FSDP.state_dict_type(fsdp, api.StateDictType.SHARDED_STATE_DICT):
        fsdp.load_state_dict(fsdp.state_dict())
    fsdp(*x).sum().backward()


def check_no_reshard_and_mixed_precision(api: FSDPApi, rank: int, world_size: int) -> None:
    _no_reshard_and_mixed_precision(api, full_prec_in_eval=False)


def check_no_reshard_and_mixed_precision_full_prec_in_eval(api: FSDPApi, rank: int, world_size: int) -> None:
    _no_reshard_and_mixed_precision(api, full_prec_in_eval=True)


def check_named_parameters_in_forward(api: FSDPApi, rank: int, world_size: int) -> None:
    seen: list[tuple[list[str], list[torch.Size]]] = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5, device=rank_device())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            named = list(self.named_parameters())
            seen.append(([_clean(n) for n, _ in named], [p.shape for _, p in named]))
            return self.lin(x)

    model = Model()
    shapes = [model.lin.weight.shape, model.lin.bias.shape]
    api.wrap(model, use_orig_params=True)(torch.randn(2, 5, device=rank_device()))
    assert seen == [(["lin.weight", "lin.bias"], shapes)], seen


def _no_sync_models(api: FSDPApi, strategy: Any):
    return [
        (m, sgd(m.parameters(), lr=1e-2, momentum=0.9))
        for m in (wrap_bottom_up(SharedTransformer(rank_device()), api.wrap, sharding_strategy=strategy, use_orig_params=o) for o in (False, True))
    ]


def check_no_sync_correctness(api: FSDPApi, rank: int, world_size: int) -> None:
    for strategy in (api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP, api.ShardingStrategy.NO_SHARD):
        pairs = _no_sync_models(api, strategy)
        for i in range(3):
            for model, opt in pairs:
                with model.no_sync():
                    inputs = _input(i, rank)
                    SharedTransformer.get_loss(inputs, model(*inputs)).backward()
                inputs = _input(i + 50, rank)
                SharedTransformer.get_loss(inputs, model(*inputs)).backward()
                opt.step()
                opt.zero_grad()
        _fsdp_params_equal(api, pairs[0][0], pairs[1][0])


def check_no_sync_mixed_precision(api: FSDPApi, rank: int, world_size: int) -> None:
    low = torch.bfloat16  # CPU kernels: bfloat16 stands in for the ported test's float16
    for strategy in (api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP, api.ShardingStrategy.NO_SHARD):
        model = api.wrap(
            nn.Linear(3, 3, device=rank_device()),
            sharding_strategy=strategy,
            mixed_precision=api.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32),
            use_orig_params=True,
        )
        x = torch.randn(2, 3, device=rank_device())
        with model.no_sync():
            for _ in range(2):
                model(x).sum().backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                assert grads and all(g.dtype == low for g in grads), (strategy, [g.dtype for g in grads])
        model(x).sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(g.dtype == torch.float32 for g in grads), (strategy, [g.dtype for g in grads])


def check_non_uniform_requires_grad(api: FSDPApi, rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(3, 3, device=rank_device()), nn.Linear(3, 3, device=rank_device()))
    model[0].bias.requires_grad = False
    model[1].bias.requires_grad = False
    fsdp = api.wrap(model, use_orig_params=True)
    assert fsdp[0].weight.requires_grad and fsdp[1].weight.requires_grad
    assert not fsdp[0].bias.requires_grad and not fsdp[1].bias.requires_grad
    fsdp(torch.randn(2, 3, device=rank_device())).sum().backward()
    assert fsdp[0].bias.grad is None and fsdp[1].bias.grad is None


CHECKS: list[Callable[[FSDPApi, int, int], None]] = [
    check_diff_hyperparams,
    check_diff_hyperparams_cpu_offload,
    check_diff_trainability,
    check_multiple_optimizers,
    check_multiple_forward,
    check_multiple_forward_cpu_offload,
    check_summon_between_two_forwards,
    check_summon_between_two_forwards_cpu_offload,
    check_access_params_after_forward,
    check_param_writeback,
    check_grad_writeback,
    check_writeback_shape_mismatch,
    check_writeback_between_fwd_and_bwd_for_no_reshard_raises,
    check_no_reshard_and_mixed_precision,
    check_no_reshard_and_mixed_precision_full_prec_in_eval,
    check_fsdp_compile,
    check_named_parameters_in_forward,
    check_no_sync_correctness,
    check_no_sync_mixed_precision,
    check_non_uniform_requires_grad,
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_hyperparam_subtests_are_the_torch_tests_product_and_smoke_shows_every_value(device: str, offload: bool) -> None:
    smoke, every = hyperparam_subtests(offload, device, smoke=True), hyperparam_subtests(offload, device, smoke=False)
    after = device == "cuda" and not offload
    assert len(every) == 144 * (2 if after else 1) and len(smoke) == 6 and all(sub in every for sub in smoke)
    for axis in HYPERPARAM_AXES:
        assert {sub[axis] for sub in smoke} == {sub[axis] for sub in every}, axis
    assert ("after" in {sub["init_mode"] for sub in every}) == after


#: The ported test's whole products where the checks above run a representative part (``slow_checks``: the slow
#: lane, ``--matrix pairwise|full``, on GPUs too).
SLOW_CHECKS: list[Callable[[FSDPApi, int, int], None]] = [
    check_diff_hyperparams_every_subtest,
    check_diff_hyperparams_cpu_offload_every_subtest,
    check_fsdp_compile_every_subtest,
]
rank_checks, test_check = api_rank_check_tests(CHECKS, load_api, device=("cpu", "cuda"), timeout_s=600, slow_checks=SLOW_CHECKS)
