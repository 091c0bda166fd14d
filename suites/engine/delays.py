"""GPU sleeps where a missing stream synchronization shows: before the gradient reduction, before
the unsharded parameters are freed, before the optimizer step; and a few training steps under them
compared with the harness's local reference (an unwrapped model trained on every rank's data).

A sleep on the compute stream makes an unsynchronized reader on another stream run before the
writer finishes, so a missing wait turns into wrong values instead of a rare race.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist

from engine import FSDP, ShardingStrategy
from engine.flat_param import FlatParamHandle
from harness.cases.case import CaseConfig
from harness.cases.model_protocol import to_device, wrap_bottom_up
from harness.cases.models import build_model
from harness.conformance.engine_models import MOE, NESTED, singleton_groups
from harness.conformance.fsdp1_checks import assert_matches_local_reference, load_api
from harness.conformance.seeds.seed_parity import ported_subtests
from harness.engines.adapters import fsdp1_options
from harness.engines.optim import sgd
from harness.ranks.rank import rank_device

#: GPU cycles to sleep (tens of milliseconds on current GPUs): long enough that an unsynchronized
#: reader runs before the writer finishes.
SLEEP_CYCLES = 50_000_000

BUILTIN = load_api("builtin")
#: What the delayed runs train, as the harness's case (its model, steps and optimizer) for the reference.
DELAYED_CASE = CaseConfig(engine="builtin", reference="local", model=NESTED, steps=4)

#: (before_reduce, before_free, before_step): one sleep at a time.
DELAYS = [(True, False, False), (False, True, False), (False, False, True)]

#: The torch test's delayed checks of test_fsdp_core.py: the model each trains and where it sleeps. Its
#: ``delay_after_loss_ms`` sleeps between the loss and the optimizer step; here the sleep is right before
#: the step, after backward (what it exposes: the next forward's all-gathers must wait for the step).
TORCH_TEST_DELAYS: dict[str, tuple[str, tuple[bool, bool, bool]]] = {
    "delayed_optim_step": (NESTED, (False, False, True)),
    "delayed_reduce_scatter": (NESTED, (True, False, False)),
    "mixture_of_experts_with_delay_before_free": (MOE, (False, True, False)),
}


def ported_delayed_cases(name: str, device: str = "cuda") -> list[CaseConfig]:
    """The subtests of the torch test's delayed check ``name`` (``TORCH_TEST_DELAYS``): the ``seed_parity`` checks' product,
    every strategy x backward prefetch x forward prefetch x use_orig_params x init mode, with and without
    CPU offload (``harness.conformance.seeds.seed_parity.ported_subtests``), on the check's model."""
    model = TORCH_TEST_DELAYS[name][0]
    return [case.replace(engine="builtin", reference="local", steps=DELAYED_CASE.steps)
            for offload in (False, True) for case in ported_subtests(model, offload, device=device)]


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


@functools.cache
def _one_rank_group() -> dist.ProcessGroup:
    """This rank's one-rank group for rank-local units, created once per rank process (a group per run
    would leave a communicator behind each time)."""
    return singleton_groups()


def _wrap_local(module: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
    """A rank-local unit (the mixture's expert): NO_SHARD over this rank's one-rank group, as the harness's
    adapters wrap it."""
    return FSDP(module, **{**kwargs, "process_group": _one_rank_group(), "sharding_strategy": ShardingStrategy.NO_SHARD})


def _build(case: CaseConfig, rank: int, world: int, device: torch.device, **kwargs: object) -> tuple[object, torch.nn.Module]:
    """The case's zoo model wrapped with ``kwargs`` in the case's init mode (``CaseConfig.init_mode``):
    moved to the device before wrapping, after it, or never (``device_id`` moves it). Built on the CPU as
    the harness builds it: a model built on the GPU draws its initial parameters from the GPU's generator,
    so it would not start where the reference does."""
    zoo = build_model(case.model, seed=case.seed, rank=rank, world_size=world)
    if case.init_mode == "before":
        zoo.to(device)
    placed = {"device_id": device} if case.init_mode == "never" else {}
    model = wrap_bottom_up(zoo, FSDP, _wrap_local, **kwargs, **placed)
    return zoo, model.to(device) if case.init_mode == "after" else model


def delayed_step_parity(kwargs: dict, before_reduce: bool, before_free: bool, before_step: bool,
                        case: CaseConfig = DELAYED_CASE) -> None:
    """``case``'s steps of its model wrapped with ``kwargs`` (and the case's own options, where ``kwargs``
    leave them out) in the case's init mode under the given sleeps; its parameters must match what the
    harness's local reference computes for the case. The training loop is this module's own: the sleeps
    patch the builtin engine's internals (``FlatParamHandle.free_unsharded_flat_param``), which the
    harness never does (its stress mode, ``harness.compare.stress``, delays every engine alike from outside).
    On CPU ranks it runs without sleeps (they need a GPU)."""
    world = torch.distributed.get_world_size()
    case = case.replace(world_size=world)
    device, rank = rank_device(), torch.distributed.get_rank()
    sleeps = device.type == "cuda"
    zoo, model = _build(case, rank, world, device, **{**fsdp1_options(BUILTIN, case), **kwargs})
    opt = sgd(model.parameters(), case.lr, case.momentum)
    # Every batch is on the GPU before the first step: a host-to-device copy from pageable memory
    # inside the loop would block the host until the compute stream (and its sleep) is done,
    # which hides a missing wait between the optimizer step and the next all-gather.
    batches = [to_device(zoo.get_input(seed=case.seed, step=step, rank=rank), device) for step in range(case.steps)]
    for inputs in batches:
        with delays(before_reduce and sleeps, before_free and sleeps):
            zoo.get_loss(inputs, model(*inputs)).backward()
        if before_step and sleeps:
            torch.cuda._sleep(SLEEP_CYCLES)
        opt.step()
        opt.zero_grad()
    where = f"delays reduce={before_reduce} free={before_free} step={before_step} {case.case_id} {kwargs}"
    assert_matches_local_reference(BUILTIN, model, case, where)


def ported_delayed_check(name: str) -> None:
    """Every subtest of the torch test's delayed check ``name`` (``ported_delayed_cases``) under its sleep."""
    plan = TORCH_TEST_DELAYS[name][1]
    for case in ported_delayed_cases(name, rank_device().type):
        delayed_step_parity({}, *plan, case=case)
