"""Models that sleep on the GPU before the gradient reduction, before the optimizer step and before
freeing unsharded parameters (each exposes a missing stream synchronization; the torch test's three delayed
checks over their whole strategy x offload x init mode x prefetch x use_orig_params product, the mixture
of experts for the delay before free), CPU offload placement
and no_sync's gradient dtypes, on 2 GPU ranks. The parity cross product runs on the GPUs as harness
cases (``suites/engine/test_parity.py``: the plugin places its ranks there; ``--matrix full`` for the
whole product).

Run on a machine with a GPU::

    python -m pytest suites/engine/test_gpu.py suites/engine/test_parity.py -m gpu -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import FSDP, CPUOffload, MixedPrecision, ShardingStrategy
from harness.cases.case import FLAT_STRATEGIES, FSDP1_STRATEGIES
from harness.cases.model_protocol import to_device, wrap_bottom_up
from harness.conformance.engine_models import NestedWrapped
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.pytest_plugin import needs_gpus
from suites.engine.delays import DELAYS, cuda_device as _device, delayed_step_parity, ported_delayed_check

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(1),
]

STRATEGIES = [ShardingStrategy[FSDP1_STRATEGIES[s]] for s in FLAT_STRATEGIES]


def check_delays_expose_missing_synchronization(rank: int, world_size: int) -> None:
    """Each sleep on every strategy x use_orig_params x offload (forward prefetch on)."""
    for strategy, orig, offload in itertools.product(STRATEGIES, [False, True], [False, True]):
        kwargs = dict(sharding_strategy=strategy, use_orig_params=orig, cpu_offload=CPUOffload(offload), forward_prefetch=True)
        for plan in DELAYS:
            delayed_step_parity(kwargs, *plan)


# The torch test's delayed checks of test_fsdp_core.py, each over its whole product (suites.engine.delays).
def check_ported_delayed_optim_step(rank: int, world_size: int) -> None:
    ported_delayed_check("delayed_optim_step")


def check_ported_delayed_reduce_scatter(rank: int, world_size: int) -> None:
    ported_delayed_check("delayed_reduce_scatter")


def check_ported_mixture_of_experts_with_delay_before_free(rank: int, world_size: int) -> None:
    ported_delayed_check("mixture_of_experts_with_delay_before_free")


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
    check_delays_expose_missing_synchronization,
    check_ported_delayed_optim_step,
    check_ported_delayed_reduce_scatter,
    check_ported_mixture_of_experts_with_delay_before_free,
    check_cpu_offload_placement,
    check_no_sync_mixed_precision_dtypes,
]
rank_checks, test_check = rank_check_tests(CHECKS, device="cuda", timeout_s=540)
