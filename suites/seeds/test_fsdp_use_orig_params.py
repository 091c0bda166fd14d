"""Seed behaviours of torch's test_fsdp_use_orig_params.py on our engine, 2 CPU ranks (gloo):
parameter groups with different hyperparameters, different trainability, multiple optimizers,
multiple forwards before backward, summon between two forwards, access after forward, parameter
and gradient writeback (and shape mismatch), no-reshard changes between forward and backward,
FQNs in forward, no_sync correctness and mixed-precision dtypes, non-uniform requires_grad.

DDP is the reference where the seed uses it; the seed's CUDA-only parts (compile) are left out.
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

from engine import FSDP, BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType
from engine.wrap import ModuleWrapPolicy
from suites.engine import parity
from suites.engine.models import SharedTransformer
from suites.engine.ranks import session_tests

CPU = torch.device("cpu")
STRATEGIES = [ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD]


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = [
        {"params": [], "weight_decay": 0.1, "lr": 1e-2},
        {"params": [], "weight_decay": 0.01, "lr": 1e-3},
        {"params": []},
    ]
    for name, p in model.named_parameters():
        groups[0 if "weight" in name else 1 if "bias" in name else 2]["params"].append(p)
    return groups


def _sgd(groups: Any, foreach: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=5e-3, momentum=0.9, weight_decay=0.0, foreach=foreach)


def _fsdp_transformer(**kwargs: Any) -> nn.Module:
    policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    return FSDP(SharedTransformer(), auto_wrap_policy=policy, use_orig_params=True, **kwargs)


def _check_param_parity(ddp: DDP, fsdp: nn.Module) -> None:
    with FSDP.summon_full_params(fsdp):
        pairs = list(zip(ddp.module.named_parameters(), fsdp.named_parameters()))
        assert len(pairs) == len(list(ddp.module.parameters()))
        for (n1, p1), (n2, p2) in pairs:
            assert n1 == _clean(n2), (n1, n2)
            assert_close(p1, p2, msg=lambda m: f"{n1}: {m}")


def _train_parity(ddp: DDP, ddp_opt, fsdp: nn.Module, fsdp_opt, set_to_none: bool, iters: int = 6) -> None:
    rank = dist.get_rank()
    for i in range(iters):
        losses = []
        for model, opt in ((ddp, ddp_opt), (fsdp, fsdp_opt)):
            if i % 2 == 0:
                opt.zero_grad(set_to_none=set_to_none)
            loss = SharedTransformer.loss(model(*SharedTransformer.input(i, rank, CPU)))
            losses.append(loss)
            if i % 2 == 1:
                # Zeroing between forward and backward must not keep the old gradient.
                opt.zero_grad(set_to_none=set_to_none)
            loss.backward()
            opt.step()
        assert_close(losses[0], losses[1], msg=lambda m: f"iter {i}: {m}")
    _check_param_parity(ddp, fsdp)


def check_diff_hyperparams(rank: int, world_size: int) -> None:
    combos = itertools.product(
        STRATEGIES, [False, True], [False, True], [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST], [False, True], [False, True]
    )
    for strategy, before_wrap, set_to_none, prefetch, skip_check, offload in combos:
        if skip_check:
            os.environ["FSDP_SKIP_WRITEBACK_CHECK"] = "1"
        try:
            ddp = DDP(SharedTransformer())
            ddp_opt = _sgd(_param_groups(ddp), foreach=set_to_none)
            kwargs = dict(sharding_strategy=strategy, backward_prefetch=prefetch, cpu_offload=CPUOffload(offload))
            if before_wrap:
                module = SharedTransformer()
                fsdp_opt = _sgd(_param_groups(module), foreach=not set_to_none)
                fsdp = FSDP(module, auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}), use_orig_params=True, **kwargs)
            else:
                fsdp = _fsdp_transformer(**kwargs)
                fsdp_opt = _sgd(_param_groups(fsdp), foreach=not set_to_none)
            _train_parity(ddp, ddp_opt, fsdp, fsdp_opt, set_to_none)
        finally:
            os.environ.pop("FSDP_SKIP_WRITEBACK_CHECK", None)


def check_diff_trainability(rank: int, world_size: int) -> None:
    for strategy, foreach in itertools.product(STRATEGIES, [False, True]):
        ddp = DDP(SharedTransformer(), find_unused_parameters=True)
        ddp_opt = _sgd(_param_groups(ddp), foreach)
        fsdp = _fsdp_transformer(sharding_strategy=strategy)
        fsdp_opt = _sgd(_param_groups(fsdp), foreach)
        for model in (ddp, fsdp):
            for name, p in model.named_parameters():
                if "bias" in name:
                    p.requires_grad_(False)
        _train_parity(ddp, ddp_opt, fsdp, fsdp_opt, set_to_none=False)


def check_multiple_optimizers(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        ddp = DDP(SharedTransformer())
        fsdp = _fsdp_transformer(sharding_strategy=strategy)
        opts = []
        for model in (ddp, fsdp):
            groups = _param_groups(model)
            # Two optimizers, only the first sets gradients to None.
            opts.append((_sgd(groups[:1], False), _sgd(groups[1:], False)))
        for i in range(5):
            losses = []
            for model, (a, b) in zip((ddp, fsdp), opts):
                a.zero_grad(set_to_none=True)
                b.zero_grad(set_to_none=False)
                loss = SharedTransformer.loss(model(*SharedTransformer.input(i, rank, CPU)))
                loss.backward()
                a.step()
                b.step()
                losses.append(loss)
            assert_close(losses[0], losses[1])
        _check_param_parity(ddp, fsdp)


def _orig_and_flat_models(strategy: ShardingStrategy, offload: bool):
    models = []
    for orig in (False, True):
        model = SharedTransformer().wrap(
            FSDP, sharding_strategy=strategy, cpu_offload=CPUOffload(offload), use_orig_params=orig
        )
        models.append((model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)))
    return models


def _fsdp_params_equal(a: nn.Module, b: nn.Module) -> None:
    with FSDP.summon_full_params(a), FSDP.summon_full_params(b):
        for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
            assert n1 == n2
            assert_close(p1, p2)


def check_multiple_forward(rank: int, world_size: int) -> None:
    for strategy, offload in itertools.product(STRATEGIES, [False, True]):
        (m1, o1), (m2, o2) = _orig_and_flat_models(strategy, offload)
        for i in range(3):
            inp1 = SharedTransformer.input(i, rank, CPU)
            inp2 = SharedTransformer.input(i + 100, rank, CPU)
            results = []
            for model, opt in ((m1, o1), (m2, o2)):
                opt.zero_grad()
                l1, l2 = SharedTransformer.loss(model(*inp1)), SharedTransformer.loss(model(*inp2))
                (l1 + l2).backward()
                opt.step()
                results.append((l1, l2))
            assert_close(results[0], results[1], msg=lambda m: f"{strategy} offload={offload}: {m}")
        _fsdp_params_equal(m1, m2)


def check_summon_between_two_forwards(rank: int, world_size: int) -> None:
    for strategy, offload in itertools.product(STRATEGIES, [False, True]):
        (m1, o1), (m2, o2) = _orig_and_flat_models(strategy, offload)
        for i in range(3):
            o1.zero_grad()
            o2.zero_grad()
            inp1 = SharedTransformer.input(i, rank, CPU)
            a1, b1 = SharedTransformer.loss(m1(*inp1)), SharedTransformer.loss(m2(*inp1))
            assert_close(a1, b1)
            _fsdp_params_equal(m1, m2)
            inp2 = SharedTransformer.input(i + 100, rank, CPU)
            a2, b2 = SharedTransformer.loss(m1(*inp2)), SharedTransformer.loss(m2(*inp2))
            assert_close(a2, b2)
            (a1 + a2).backward()
            (b1 + b2).backward()
            o1.step()
            o2.step()
        _fsdp_params_equal(m1, m2)


class _Lin2(nn.Module):
    """The seed's writeback model: Linear(5, 5) -> ReLU -> Linear(5, 7)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.randn((2, 5)).to(device),)


def check_access_params_after_forward(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        ref = _Lin2()
        model = FSDP(_Lin2(), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
        x = model.get_input(CPU)
        model(*x)
        for name in ("weight", "bias"):
            p = getattr(model.module.lin1, name)
            full = getattr(ref.lin1, name).detach().reshape(-1)
            if strategy == ShardingStrategy.FULL_SHARD:
                # Resharded: the sharded, flattened original parameter.
                start = rank * p.numel() if rank == 0 else full.numel() - p.numel()
                assert p.dim() == 1 and p.numel() <= full.numel()
                assert_close(p.detach(), full[start : start + p.numel()] if rank == 0 else full[full.numel() - p.numel() :])
            else:
                # Not resharded: the unsharded view used by forward.
                assert_close(p.detach(), getattr(ref.lin1, name).detach())


def check_param_writeback(rank: int, world_size: int) -> None:
    def transform(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(torch.ones_like(p) * 2)

    for first, change_data in itertools.product([True, False], [True, False]):
        ddp = DDP(_Lin2())
        fsdp = FSDP(_Lin2(), use_orig_params=True)
        for m in (ddp.module, fsdp.module):
            lin = m.lin1 if first else m.lin2
            if change_data:
                lin.weight.data = transform(lin.weight)
            else:
                lin.weight = transform(lin.weight)
        _check_param_parity(ddp, fsdp)


def check_grad_writeback(rank: int, world_size: int) -> None:
    for first, change_data, set_to_none in itertools.product([False, True], [False, True], [False, True]):
        if change_data and set_to_none:
            continue

        def transform(p: nn.Parameter) -> torch.Tensor | None:
            return None if set_to_none else torch.ones_like(p) * 2

        ddp = DDP(_Lin2())
        fsdp = FSDP(_Lin2(), use_orig_params=True)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-2, momentum=0.9)
        fsdp_opt = torch.optim.SGD(fsdp.parameters(), lr=1e-2, momentum=0.9)
        for step in range(2):
            torch.manual_seed(step + 10 * rank)
            x = fsdp.get_input(CPU)
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
            _check_param_parity(ddp, fsdp)
            # Gradients deliberately not zeroed: the next backward accumulates onto the writeback.


def check_writeback_shape_mismatch(rank: int, world_size: int) -> None:
    fsdp = FSDP(_Lin2(), use_orig_params=True)
    lin = fsdp.module.lin1 if rank == 0 else fsdp.module.lin2
    shape = [d + 1 for d in lin.weight.shape]
    lin.weight = nn.Parameter(torch.randn(shape))
    lin.weight.grad = torch.randn(shape)
    with pytest.raises(RuntimeError, match="Cannot writeback when the parameter shape changes"):
        with FSDP.summon_full_params(fsdp):
            pass
    fsdp = FSDP(_Lin2(), use_orig_params=True)
    lin = fsdp.module.lin1 if rank == 0 else fsdp.module.lin2
    # ``.grad =`` itself refuses another shape; ``.grad.data`` does not.
    lin.weight.grad = torch.zeros_like(lin.weight)
    lin.weight.grad.data = torch.randn([d + 1 for d in lin.weight.shape])
    with pytest.raises(RuntimeError, match="Cannot writeback when the gradient shape changes"):
        with FSDP.summon_full_params(fsdp):
            pass


def check_writeback_between_fwd_and_bwd_for_no_reshard_raises(rank: int, world_size: int) -> None:
    kwargs = dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    msg = "FSDP does not support changing the parameters between forward and backward"
    fsdp = FSDP(_Lin2(), **kwargs)
    loss = fsdp(*fsdp.get_input(CPU)).sum()
    fsdp.lin1.weight.data = fsdp.lin1.weight.clone()
    with pytest.raises(AssertionError, match=msg):
        loss.backward()
    fsdp = FSDP(_Lin2(), **kwargs)
    loss = fsdp(*fsdp.get_input(CPU)).sum()
    fsdp.lin1._fsdp_wrapped_module.weight = nn.Parameter(fsdp.lin1.weight.clone())
    with pytest.raises(AssertionError, match=msg):
        loss.backward()
    # FSDP_SKIP_WRITEBACK_CHECK=1 turns the check off.
    os.environ["FSDP_SKIP_WRITEBACK_CHECK"] = "1"
    try:
        fsdp = FSDP(_Lin2(), **kwargs)
        loss = fsdp(*fsdp.get_input(CPU)).sum()
        fsdp.lin1.weight.data = fsdp.lin1.weight.clone()
        loss.backward()
    finally:
        os.environ.pop("FSDP_SKIP_WRITEBACK_CHECK")


def check_no_reshard_and_mixed_precision(rank: int, world_size: int) -> None:
    fsdp = FSDP(
        _Lin2(),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        use_orig_params=True,
    )
    x = fsdp.get_input(CPU)
    fsdp(*x)
    with FSDP.summon_full_params(fsdp):
        pass
    fsdp.train()
    fsdp(*x)
    fsdp.eval()
    fsdp(*x)
    fsdp.train()
    fsdp(*x).sum().backward()
    fsdp.eval()
    fsdp(*x)
    with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
        fsdp.load_state_dict(fsdp.state_dict())
    fsdp(*x).sum().backward()


def check_named_parameters_in_forward(rank: int, world_size: int) -> None:
    seen: list[tuple[list[str], list[torch.Size]]] = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            named = list(self.named_parameters())
            seen.append(([_clean(n) for n, _ in named], [p.shape for _, p in named]))
            return self.lin(x)

    model = Model()
    shapes = [model.lin.weight.shape, model.lin.bias.shape]
    FSDP(model, use_orig_params=True)(torch.randn(2, 5))
    assert seen == [(["lin.weight", "lin.bias"], shapes)], seen


def _no_sync_models(strategy: ShardingStrategy):
    return [
        (m, torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9))
        for m in (SharedTransformer().wrap(FSDP, sharding_strategy=strategy, use_orig_params=o) for o in (False, True))
    ]


def check_no_sync_correctness(rank: int, world_size: int) -> None:
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        pairs = _no_sync_models(strategy)
        for i in range(3):
            for model, opt in pairs:
                with model.no_sync():
                    SharedTransformer.loss(model(*SharedTransformer.input(i, rank, CPU))).backward()
                SharedTransformer.loss(model(*SharedTransformer.input(i + 50, rank, CPU))).backward()
                opt.step()
                opt.zero_grad()
        _fsdp_params_equal(pairs[0][0], pairs[1][0])
        # And both equal the all-data reference.
        parity.accumulation_parity("transformer", dict(sharding_strategy=strategy, use_orig_params=True), CPU, use_no_sync=True)


def check_no_sync_mixed_precision(rank: int, world_size: int) -> None:
    low = torch.bfloat16  # CPU kernels: bfloat16 stands in for the seed's float16
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        model = FSDP(
            nn.Linear(3, 3),
            sharding_strategy=strategy,
            mixed_precision=MixedPrecision(param_dtype=low, reduce_dtype=torch.float32),
            use_orig_params=True,
        )
        x = torch.randn(2, 3)
        with model.no_sync():
            for _ in range(2):
                model(x).sum().backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                assert grads and all(g.dtype == low for g in grads), (strategy, [g.dtype for g in grads])
        model(x).sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(g.dtype == torch.float32 for g in grads), (strategy, [g.dtype for g in grads])


def check_non_uniform_requires_grad(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[0].bias.requires_grad = False
    model[1].bias.requires_grad = False
    fsdp = FSDP(model, use_orig_params=True)
    assert fsdp[0].weight.requires_grad and fsdp[1].weight.requires_grad
    assert not fsdp[0].bias.requires_grad and not fsdp[1].bias.requires_grad
    fsdp(torch.randn(2, 3)).sum().backward()
    assert fsdp[0].bias.grad is None and fsdp[1].bias.grad is None


CHECKS: list[Callable[[int, int], None]] = [
    check_diff_hyperparams,
    check_diff_trainability,
    check_multiple_optimizers,
    check_multiple_forward,
    check_summon_between_two_forwards,
    check_access_params_after_forward,
    check_param_writeback,
    check_grad_writeback,
    check_writeback_shape_mismatch,
    check_writeback_between_fwd_and_bwd_for_no_reshard_raises,
    check_no_reshard_and_mixed_precision,
    check_named_parameters_in_forward,
    check_no_sync_correctness,
    check_no_sync_mixed_precision,
    check_non_uniform_requires_grad,
]
session, test_check = session_tests(CHECKS, timeout_s=400)
