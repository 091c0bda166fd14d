"""The parity cross product on 2 GPUs with NCCL, plus models that sleep on the GPU before the
gradient reduction, before the optimizer step and before freeing unsharded parameters (each
exposes a missing stream synchronization), and CPU offload placement.

Run on a machine with 2 GPUs::

    python -m pytest suites/engine/test_gpu.py -m gpu -q
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator
from unittest import mock

import pytest
import torch
from harness.pytest_plugin import needs_gpus

from engine import FSDP, CPUOffload, MixedPrecision
from engine.flat_param import FlatParamHandle
from harness.model_protocol import to_device, wrap_bottom_up
from suites.engine import parity
from suites.engine.models import NestedWrapped
from suites.engine.ranks import session_tests

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(2),
]

STRATEGIES = parity.STRATEGIES
#: GPU cycles to sleep (tens of milliseconds on current GPUs): long enough that an unsynchronized
#: reader runs before the writer finishes.
SLEEP_CYCLES = 50_000_000


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def check_nested_sweep(rank: int, world_size: int) -> None:
    parity.sweep("nested", _device())


def check_transformer_sweep(rank: int, world_size: int) -> None:
    parity.sweep("transformer", _device())


def check_moe_sweep(rank: int, world_size: int) -> None:
    parity.sweep("moe", _device())


@contextlib.contextmanager
def _delays(before_reduce: bool, before_free: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if before_reduce:
            orig_rs = torch.distributed.reduce_scatter_tensor
            orig_ar = torch.distributed.all_reduce

            def slow_rs(*args, **kwargs):
                torch.cuda._sleep(SLEEP_CYCLES)
                return orig_rs(*args, **kwargs)

            def slow_ar(*args, **kwargs):
                torch.cuda._sleep(SLEEP_CYCLES)
                return orig_ar(*args, **kwargs)

            stack.enter_context(mock.patch("torch.distributed.reduce_scatter_tensor", slow_rs))
            stack.enter_context(mock.patch("torch.distributed.all_reduce", slow_ar))
        if before_free:
            orig_free = FlatParamHandle.free_unsharded_flat_param

            def slow_free(self):
                torch.cuda._sleep(SLEEP_CYCLES)
                return orig_free(self)

            stack.enter_context(mock.patch.object(FlatParamHandle, "free_unsharded_flat_param", slow_free))
        yield


def _delayed_step_parity(kwargs: dict, before_reduce: bool, before_free: bool, before_step: bool) -> None:
    device, rank, world = _device(), torch.distributed.get_rank(), torch.distributed.get_world_size()
    ref = NestedWrapped(device)
    model = wrap_bottom_up(NestedWrapped(device), FSDP, **kwargs)
    opt, ref_opt = parity._optim(model.parameters()), parity._optim(ref.parameters())
    for step in range(4):
        with _delays(before_reduce, before_free):
            inputs = to_device(NestedWrapped.get_input(step=step, rank=rank), device)
            loss = NestedWrapped.get_loss(inputs, model(*inputs))
            loss.backward()
        if before_step:
            torch.cuda._sleep(SLEEP_CYCLES)
        opt.step()
        opt.zero_grad()
        all_inputs = parity._all_data(NestedWrapped, step, world, device)
        NestedWrapped.get_loss(all_inputs, ref(*all_inputs)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    parity.assert_params_match(model, ref, f"delays reduce={before_reduce} free={before_free} step={before_step} {kwargs}")


def check_delays_expose_missing_synchronization(rank: int, world_size: int) -> None:
    for strategy, orig, offload in itertools.product(STRATEGIES, [False, True], [False, True]):
        kwargs = dict(sharding_strategy=strategy, use_orig_params=orig, cpu_offload=CPUOffload(offload), forward_prefetch=True)
        for delays in [(True, False, False), (False, True, False), (False, False, True)]:
            _delayed_step_parity(kwargs, *delays)


def check_cpu_offload_placement(rank: int, world_size: int) -> None:
    for orig in (False, True):
        model = wrap_bottom_up(NestedWrapped(_device()), FSDP, cpu_offload=CPUOffload(offload_params=True), use_orig_params=orig)
        inputs = to_device(NestedWrapped.get_input(step=0, rank=rank), _device())
        NestedWrapped.get_loss(inputs, model(*inputs)).backward()
        for name, p in model.named_parameters():
            assert p.device.type == "cpu", f"{name} on {p.device}"
            if p.grad is not None:
                assert p.grad.device.type == "cpu", f"{name}.grad on {p.grad.device}"
        torch.optim.SGD(model.parameters(), lr=0.1).step()


def check_no_sync_mixed_precision_dtypes(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        model = FSDP(
            torch.nn.Linear(3, 3, device=_device()),
            sharding_strategy=strategy,
            mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
            use_orig_params=True,
        )
        x = torch.randn(2, 3, device=_device())
        with model.no_sync():
            for _ in range(2):
                model(x).sum().backward()
                for p in model.parameters():
                    if p.grad is not None:
                        assert p.grad.dtype == torch.float16, (strategy, p.grad.dtype)
        model(x).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                assert p.grad.dtype == torch.float32, (strategy, p.grad.dtype)


CHECKS = [
    check_nested_sweep,
    check_transformer_sweep,
    check_moe_sweep,
    check_delays_expose_missing_synchronization,
    check_cpu_offload_placement,
    check_no_sync_mixed_precision_dtypes,
]
session, test_check = session_tests(CHECKS, backend="nccl", timeout_s=540)
