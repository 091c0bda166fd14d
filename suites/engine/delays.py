"""GPU sleeps where a missing stream synchronization shows: before the gradient reduction, before
the unsharded parameters are freed, before the optimizer step; and a few training steps under them
compared with the harness's local reference (an unwrapped model trained on every rank's data).

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
from harness.case import CaseConfig
from harness.conformance.engine_models import NESTED
from harness.conformance.fsdp1_checks import assert_matches_local_reference, load_api
from harness.model_protocol import to_device, wrap_bottom_up
from harness.models import build_model
from harness.optim import sgd

#: GPU cycles to sleep (tens of milliseconds on current GPUs): long enough that an unsynchronized
#: reader runs before the writer finishes.
SLEEP_CYCLES = 50_000_000

BUILTIN = load_api("builtin")
#: What the delayed runs train, as the harness's case (its model, steps and optimizer) for the reference.
DELAYED_CASE = CaseConfig(engine="builtin", reference="local", model=NESTED, steps=4)

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
    """``DELAYED_CASE``'s steps of its model wrapped with ``kwargs`` under the given sleeps; its parameters
    must match what the harness's local reference computes for the case. The training loop is this
    module's own: the sleeps patch the builtin engine's internals (``FlatParamHandle.free_unsharded_flat_param``),
    which the harness never does (its stress mode, ``harness.stress``, delays every engine alike from outside)."""
    world = torch.distributed.get_world_size()
    case = DELAYED_CASE.replace(world_size=world)
    device, rank = cuda_device(), torch.distributed.get_rank()
    # Built as the harness builds it (on the CPU, then moved): a model built on the GPU draws its
    # initial parameters from the GPU's generator, so it would not start where the reference does.
    zoo = build_model(case.model, seed=case.seed, rank=rank, world_size=world).to(device)
    model = wrap_bottom_up(zoo, FSDP, **kwargs)
    opt = sgd(model.parameters(), case.lr, case.momentum)
    # Every batch is on the GPU before the first step: a host-to-device copy from pageable memory
    # inside the loop would block the host until the compute stream (and its sleep) is done,
    # which hides a missing wait between the optimizer step and the next all-gather.
    batches = [to_device(zoo.get_input(seed=case.seed, step=step, rank=rank), device) for step in range(case.steps)]
    for inputs in batches:
        with delays(before_reduce, before_free):
            zoo.get_loss(inputs, model(*inputs)).backward()
        if before_step:
            torch.cuda._sleep(SLEEP_CYCLES)
        opt.step()
        opt.zero_grad()
    assert_matches_local_reference(BUILTIN, model, case, f"delays reduce={before_reduce} free={before_free} step={before_step} {kwargs}")
