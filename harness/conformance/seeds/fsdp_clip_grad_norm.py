"""``clip_grad_norm_`` as torch FSDP1 documents it, as conformance checks against every engine with its API
(``fsdp_api``: our engine and torch FSDP1), 2 ranks on the CPU and on the GPUs: the total norm of the whole gradient over
shards (compared with the unsharded model's), every gradient clipped by it, the norm returned in the
"largest" gradient dtype (float16 with low-precision gradients), and on a rank without gradients a
warning and float32.
"""

from __future__ import annotations

import itertools
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.cases.model_protocol import to_device, wrap_bottom_up
from harness.conformance.engine_models import NestedWrapped
from harness.conformance.fsdp1_checks import FSDPApi, all_data, assert_match, assert_params_match, load_api
from harness.pytest_plugin.rank_checks import api_rank_check_tests
from harness.ranks.rank import rank_device

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["rank_checks", "test_check"]


def check_norm_over_shards_and_clipped_gradients(api: FSDPApi, rank: int, world_size: int) -> None:
    kinds = [api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP, api.ShardingStrategy.NO_SHARD]
    device = rank_device()
    for strategy, orig, norm_type in itertools.product(kinds, [False, True], [2.0, float("inf")]):
        ref = NestedWrapped(device)
        model = wrap_bottom_up(NestedWrapped(device), api.wrap, sharding_strategy=strategy, use_orig_params=orig)
        inputs = to_device(NestedWrapped.get_input(step=0, rank=rank), device)
        NestedWrapped.get_loss(inputs, model(*inputs)).backward()
        data = all_data(NestedWrapped, 0, world_size, device)
        NestedWrapped.get_loss(data, ref(*data)).backward()
        total = model.clip_grad_norm_(0.01, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type)
        context = f"{strategy} orig={orig} norm_type={norm_type}"
        assert total.dtype == torch.float32, context
        assert_match("clip_norm@0", total, ref_total, context)
        # The clipped gradients, through an SGD step without momentum: parameter - grad.
        for p in model.parameters():
            if p.grad is not None:
                p.data -= p.grad
        for p in ref.parameters():
            p.data -= p.grad
        assert_params_match(api, model, ref, context)


def check_norm_dtype_follows_the_gradients(api: FSDPApi, rank: int, world_size: int) -> None:
    mp = api.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True)
    model = wrap_bottom_up(NestedWrapped(rank_device()), api.wrap, mixed_precision=mp)
    inputs = to_device(NestedWrapped.get_input(step=0, rank=rank), rank_device())
    NestedWrapped.get_loss(inputs, model(*inputs)).backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float16}
    assert model.clip_grad_norm_(1.0).dtype == torch.float16


def check_a_rank_without_gradients_warns(api: FSDPApi, rank: int, world_size: int) -> None:
    model = api.wrap(nn.Linear(4, 4, device=rank_device()), use_orig_params=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = model.clip_grad_norm_(1.0)
    assert total.dtype == torch.float32 and float(total) == 0.0
    assert any("with no gradients" in str(w.message) for w in caught), [str(w.message) for w in caught]
    dist.barrier()


CHECKS = [
    check_norm_over_shards_and_clipped_gradients,
    check_norm_dtype_follows_the_gradients,
    check_a_rank_without_gradients_warns,
]
rank_checks, test_check = api_rank_check_tests(CHECKS, load_api, device=("cpu", "cuda"))
