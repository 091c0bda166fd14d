"""GPU sleeps where a missing stream synchronization shows: before the gradient reduction, before
the unsharded parameters are freed, before the optimizer step; and a few training steps under them
compared with an unwrapped model trained on every rank's data.

A sleep on the compute stream makes an unsynchronized reader on another stream run before the
writer finishes, so a missing wait turns into wrong values instead of a rare race.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch

from engine import FSDP
from engine.flat_param import FlatParamHandle
from harness.model_protocol import to_device, wrap_bottom_up
from suites.engine import parity
from suites.engine.models import NestedWrapped
from suites.seeds.api import all_data, optim

#: GPU cycles to sleep (tens of milliseconds on current GPUs): long enough that an unsynchronized
#: reader runs before the writer finishes.
SLEEP_CYCLES = 50_000_000

#: (before_reduce, before_free, before_step): one sleep at a time.
DELAYS = [(True, False, False), (False, True, False), (False, False, True)]


def cuda_device() -> torch.device:
    """This rank's current GPU."""
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def delays(before_reduce: bool, before_free: bool) -> Iterator[None]:
    """Sleep on the compute stream before each reduction collective and/or each free."""
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


def delayed_step_parity(kwargs: dict, before_reduce: bool, before_free: bool, before_step: bool) -> None:
    """Four steps of the nested model wrapped with ``kwargs`` under the given sleeps; its parameters
    must match the unwrapped model trained on every rank's batches."""
    device, rank, world = cuda_device(), torch.distributed.get_rank(), torch.distributed.get_world_size()
    ref = NestedWrapped(device)
    model = wrap_bottom_up(NestedWrapped(device), FSDP, **kwargs)
    opt, ref_opt = optim(model.parameters()), optim(ref.parameters())
    steps = range(4)
    # Every batch is on the GPU before the first step: a host-to-device copy from pageable memory
    # inside the loop would block the host until the compute stream (and its sleep) is done,
    # which hides a missing wait between the optimizer step and the next all-gather.
    batches = [to_device(NestedWrapped.get_input(step=step, rank=rank), device) for step in steps]
    all_batches = [all_data(NestedWrapped, step, world, device) for step in steps]
    for inputs, all_inputs in zip(batches, all_batches):
        with delays(before_reduce, before_free):
            loss = NestedWrapped.get_loss(inputs, model(*inputs))
            loss.backward()
        if before_step:
            torch.cuda._sleep(SLEEP_CYCLES)
        opt.step()
        opt.zero_grad()
        NestedWrapped.get_loss(all_inputs, ref(*all_inputs)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    parity.assert_params_match(model, ref, f"delays reduce={before_reduce} free={before_free} step={before_step} {kwargs}")
